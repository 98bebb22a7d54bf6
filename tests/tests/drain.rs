//! Rolling restarts: a `dexa worker` sent SIGTERM claims nothing more, lets
//! its running Steps finish up to `[worker] drain`, then hands back the
//! leases of the rest so that another worker takes them at once (the same
//! attempt when the Step had produced nothing, else the next, as when a
//! worker is lost). Real worker processes, held at exact points by file
//! gates.

use std::time::{Duration, Instant};

use dexa::flow::{history, StepHistoryEntry};
use dexa::session::{event_type, step, ToolEffect};
use dexa_tests::kit::{
    entries, render_config, wait_for_turns, AgentTestStack, KitAgent, KitSettings,
};
use dexa_tests::session::last_text;
use serde_json::{json, Value};

const AGENT: &str = "Drain";

fn call(id: &str, tool: &str, args: Value) -> Value {
    json!({"id": id, "name": tool, "arguments": args})
}

/// The final status of tool call `id` in its tool_call_finished events.
async fn finished(stack: &AgentTestStack, session: &str, id: &str) -> Vec<String> {
    dexa_tests::session::all_events(&stack.sessions(AGENT), session)
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TOOL_CALL_FINISHED)
        .filter(|e| e.data["tool_call_id"] == id)
        .map(|e| e.data["status"].as_str().unwrap_or_default().to_string())
        .collect()
}

fn no_attempt_failed(history: &[StepHistoryEntry]) {
    let failed: Vec<&StepHistoryEntry> = history
        .iter()
        .filter(|e| {
            e.event_type == history::ATTEMPT_FAILED || e.event_type == history::EXECUTE_FAILED
        })
        .collect();
    assert!(failed.is_empty(), "an attempt was spent: {failed:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_lets_a_running_single_attempt_tool_finish_and_spends_no_attempt() {
    let agent = KitAgent::scripted(
        AGENT,
        json!({"turns": [
            {"steps": [{"tool_calls": [call("nw", "gate", json!({"name": "nw"}))]}, {"text": "paid"}]},
            {"steps": [{"text": "second turn"}]}
        ]}),
    )
    .tool("gate-tool")
    .policy("gate", ToolEffect::NonIdempotentWrite, Some(false));
    let mut stack = AgentTestStack::new(vec![agent]);
    let first = stack.start_worker();
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate("nw").wait_until_reached().await;
    let second = stack.start_worker();

    // Restart the first worker while its single-attempt write runs.
    stack.worker(first).terminate();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        stack.worker(first).exit_status().is_none(),
        "a draining worker waits for its running Step"
    );
    stack.gate("nw").release();
    let status = stack
        .worker(first)
        .wait_for_exit(Duration::from_secs(20))
        .await
        .unwrap_or_else(|| panic!("the drained worker did not exit"));
    assert!(status.success(), "{status:?}");
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(last_text(&snapshot).as_deref(), Some("paid"));
    assert_eq!(finished(&stack, "s1", "nw").await, vec!["succeeded"]);
    assert_eq!(stack.invocations().count("nw"), 1, "it ran once");

    // Then the second worker, idle: it exits at once, and a new one serves
    // the next turn.
    let third = stack.start_worker();
    let stopping = Instant::now();
    stack.worker(second).terminate();
    let status = stack
        .worker(second)
        .wait_for_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("an idle worker did not exit on SIGTERM"));
    assert!(status.success(), "{status:?}");
    assert!(
        // Well under the 30 s drain, with room for a busy machine.
        stopping.elapsed() < Duration::from_secs(15),
        "an idle worker has nothing to drain"
    );
    sessions.send_user_message("s1", "again").await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(last_text(&snapshot).as_deref(), Some("second turn"));
    assert!(stack.worker(third).exit_status().is_none());

    let history = stack.read_step_history("s1").await;
    assert_eq!(
        entries(&history, step::CALL_SINGLE_ATTEMPT_TOOL),
        vec![(history::EXECUTE_COMPLETED.to_string(), 1)],
        "committed once, on its first attempt"
    );
    no_attempt_failed(&history);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_still_running_at_the_drain_deadline_is_handed_back_at_once() {
    let agent = KitAgent::scripted(
        AGENT,
        json!({"turns": [{"steps": [
            {"tool_calls": [call("r", "gate", json!({"name": "r"}))]},
            {"text": "read"}
        ]}]}),
    )
    .tool("gate-tool")
    .policy("gate", ToolEffect::Read, None);
    // Leases of 30 s: a takeover within seconds is the hand-back, not
    // their running out.
    let settings = KitSettings {
        lease: Duration::from_secs(30),
        ..KitSettings::default()
    };
    let mut stack = AgentTestStack::with_config(|_| {
        render_config(&[agent], &settings).replacen("[worker]\n", "[worker]\ndrain = \"1s\"\n", 1)
    });
    // Logs as a log pipeline reads them: one JSON object a line.
    let first = stack.start_worker_with_env(&["--log-format", "json"], &[("RUST_LOG", "info")]);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate("r").wait_until_reached().await;
    let _second = stack.start_worker();

    let stopping = Instant::now();
    stack.worker(first).terminate();
    let status = stack
        .worker(first)
        .wait_for_exit(Duration::from_secs(15))
        .await
        .unwrap_or_else(|| panic!("the worker did not exit after its drain deadline"));
    assert!(status.success(), "{status:?}");
    assert!(
        stopping.elapsed() >= Duration::from_secs(1),
        "it waited out the drain"
    );
    let log = stack.worker_log(first);
    let lines: Vec<Value> = log
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {line}"))
        })
        .collect();
    let said = |message: &str| {
        lines
            .iter()
            .find(|l| {
                l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with(message))
            })
            .cloned()
            .unwrap_or_else(|| panic!("no {message:?} line in\n{log}"))
    };
    assert_eq!(said("worker ready")["worker"], json!("worker-1"));
    assert_eq!(said("drain deadline passed")["released"], json!(1));
    assert_eq!(said("worker stopped")["level"], json!("INFO"));
    // The other worker runs the read again well inside the 30 s lease.
    let log = stack.invocations();
    dexa_tests::kit::wait_until("the read to run again", Duration::from_secs(15), || {
        let log = log.clone();
        async move { (log.count("r") >= 2).then_some(()) }
    })
    .await;
    assert!(
        stopping.elapsed() < Duration::from_secs(20),
        "taken over after {:?}, as if the lease had run out",
        stopping.elapsed()
    );
    stack.gate("r").release();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(last_text(&snapshot).as_deref(), Some("read"));
    assert_eq!(finished(&stack, "s1", "r").await, vec!["succeeded"]);
    // The read had run (its heartbeats are recorded as output), so it may
    // have acted: like a lost worker's, its attempt counts, and the next one
    // runs at once rather than when the lease runs out.
    let history = stack.read_step_history("s1").await;
    assert_eq!(
        entries(&history, step::CALL_TOOL),
        vec![
            (history::ATTEMPT_FAILED.to_string(), 1),
            (history::EXECUTE_COMPLETED.to_string(), 2)
        ],
    );
    let cut = history
        .iter()
        .find(|e| e.event_type == history::ATTEMPT_FAILED)
        .and_then(|e| e.detail.clone())
        .unwrap_or_default();
    assert!(cut.contains("drain deadline"), "{cut}");
}
