//! Cancelling a running turn, and steering, with the turn on a `dexa
//! worker` in another process: during a model call, during parallel tool
//! calls, during an approval wait, with a single-attempt write in flight.
//!
//! A guest call stopped by the cancel never passes its gate: each test
//! opens the gate 100 ms after the cancel request, and a call still running
//! then would write `<gate>.passed` within 2 ms. The invocation log shows
//! that nothing ran twice; the next turn's history holds the note.

use std::time::{Duration, Instant, SystemTime};

use dexa::session::{
    event_type, AgentEvent, AgentSessionClient, AgentSnapshot, CancelOutcome, MessageRole,
    ToolEffect,
};
use dexa_tests::kit::{
    wait_for_agent_snapshot, wait_for_turns, AgentTestStack, KitAgent, KitSettings,
};
use dexa_tests::session::{all_events, texts_of, Backend, BACKEND};
use serde_json::{json, Value};

const AGENT: &str = "Cancel";

/// How long after the cancel request the gate opens: a call not stopped by
/// then passes it. Not the 100 ms the stop takes on this machine (printed
/// from the worker's log, see `interrupt_latency`), so that a busy machine
/// does not fail it; the workers' leases are long (below), so only the
/// push, not a lease renewal, stops a call this soon.
const INTERRUPT_WITHIN: Duration = Duration::from_secs(1);

/// The workers' lease: a Step whose task was taken is noticed at a renewal
/// a third of this later, far past [`INTERRUPT_WITHIN`].
const LEASE: Duration = Duration::from_secs(30);

/// A bound for the test, not the expectation (see the closing note's
/// figures): the turn ends one worker pickup and one commit after the
/// request.
const ENDS_WITHIN: Duration = Duration::from_secs(20);

fn stack(turns: Value, policies: &[(&str, ToolEffect, Option<bool>)]) -> AgentTestStack {
    let mut agent = KitAgent::scripted(AGENT, json!({ "turns": turns })).tool("gate-tool");
    for (tool, effect, approval) in policies {
        agent = agent.policy(tool, *effect, *approval);
    }
    AgentTestStack::with_settings(
        vec![agent],
        KitSettings {
            lease: LEASE,
            ..KitSettings::default()
        },
    )
}

fn call(id: &str, tool: &str, args: Value) -> Value {
    json!({"id": id, "name": tool, "arguments": args})
}

async fn events_of(sessions: &AgentSessionClient, kind: &str) -> Vec<AgentEvent> {
    all_events(sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == kind)
        .collect()
}

/// Cancels s1's running turn and returns how long until `turn_cancelled`
/// was stored, having opened `gates` [`INTERRUPT_WITHIN`] after the request.
async fn cancel(stack: &AgentTestStack, gates: &[&str]) -> Duration {
    let sessions = stack.sessions(AGENT);
    let requested_at = SystemTime::now();
    let requested = Instant::now();
    let outcome = sessions.cancel_turn("s1").await.unwrap();
    assert_eq!(
        outcome,
        CancelOutcome::Cancelled {
            turn_id: "turn-1".into()
        }
    );
    let mut ended = None;
    let mut opened = false;
    while ended.is_none() || !opened {
        if !opened && requested.elapsed() >= INTERRUPT_WITHIN {
            for gate in gates {
                stack.gate(gate).release();
            }
            opened = true;
        }
        if ended.is_none()
            && !events_of(&sessions, event_type::TURN_CANCELLED)
                .await
                .is_empty()
        {
            ended = Some(requested.elapsed());
        }
        assert!(
            requested.elapsed() < ENDS_WITHIN,
            "the turn did not end within {ENDS_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // A call still running would pass its open gate within 2 ms.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for gate in gates {
        assert!(
            !stack.gates_dir().join(format!("{gate}.passed")).exists(),
            "the call at gate {gate} was not stopped within {INTERRUPT_WITHIN:?} of the cancel"
        );
    }
    let ended = ended.unwrap_or_default();
    let stopped = stopped_after(stack, requested_at);
    eprintln!(
        "cancel: turn_cancelled stored {ended:?} after the request; guest calls stopped after {stopped:?}"
    );
    ended
}

/// A worker that logs each Step it stops (`start_worker` logs warnings
/// only).
fn start(stack: &mut AgentTestStack) -> usize {
    stack.start_worker_with_env(&[], &[("RUST_LOG", "info")])
}

/// How long after `requested_at` the workers logged stopping Steps: the
/// interrupt's latency, read from the log lines' timestamps (a figure to
/// print, not to assert: a busy machine may take longer).
fn stopped_after(stack: &AgentTestStack, requested_at: SystemTime) -> Vec<Duration> {
    let mut stopped = Vec::new();
    for worker in 0..stack.worker_count() {
        for line in stack.worker_log(worker).lines() {
            if !line.contains("the Step was stopped") {
                continue;
            }
            let at = line
                .split_whitespace()
                .next()
                .and_then(|stamp| humantime::parse_rfc3339_weak(stamp.trim_end_matches('Z')).ok());
            if let Some(elapsed) = at.and_then(|at| at.duration_since(requested_at).ok()) {
                stopped.push(elapsed);
            }
        }
    }
    stopped
}

/// The session after its cancelled turn: idle, no error, its note last.
async fn after_cancel(sessions: &AgentSessionClient) -> AgentSnapshot {
    let snapshot = wait_for_agent_snapshot(sessions, "s1", "the cancelled turn's end", |s| {
        s.state
            .as_ref()
            .is_some_and(|st| st.active_turn_id.is_none())
            .then(|| s.clone())
    })
    .await;
    let state = snapshot.state.as_ref().unwrap();
    assert_eq!(state.last_turn_error, None, "a cancel is not a failure");
    assert!(snapshot.tool_calls.is_empty() && snapshot.pending_interrupts.is_empty());
    let note = snapshot.messages.last().and_then(|m| m.text.clone());
    assert!(
        note.as_deref()
            .is_some_and(|n| n.starts_with("[Dex] The user cancelled the previous turn")),
        "{note:?}"
    );
    snapshot
}

/// (tool call id, status) of every tool_call_finished event.
async fn finished(sessions: &AgentSessionClient) -> Vec<(String, String)> {
    events_of(sessions, event_type::TOOL_CALL_FINISHED)
        .await
        .into_iter()
        .map(|e| {
            (
                e.data["tool_call_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                e.data["status"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// The next turn runs, and its history holds the note before its message.
async fn next_turn_sees_the_note(sessions: &AgentSessionClient) {
    sessions.send_user_message("s1", "next").await.unwrap();
    let snapshot = wait_for_turns(sessions, "s1", 2).await;
    let users = texts_of(&snapshot, MessageRole::User);
    let n = users.len();
    assert!(n >= 2, "{users:?}");
    assert!(users[n - 2].starts_with("[Dex] The user cancelled the previous turn"));
    assert_eq!(users[n - 1], "next");
    assert_eq!(
        texts_of(&snapshot, MessageRole::Assistant)
            .last()
            .map(String::as_str),
        Some("after")
    );
}

async fn a_cancel_during_a_model_call_that_sleeps_30_s_stops_it_and_ends_the_turn() {
    let mut stack = stack(
        json!([
            {"steps": [{"log": "model", "sleep_ms": 30000, "text": "too late"}]},
            {"steps": [{"text": "after"}]}
        ]),
        &[],
    );
    let worker = start(&mut stack);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "think long").await.unwrap();
    stack.invocations().wait_for_count("model", 1).await;
    let ended = cancel(&stack, &[]).await;
    after_cancel(&sessions).await;
    // The worker stopped the sleeping call (its slot is free again).
    let mut stopped = false;
    for _ in 0..200 {
        if stack
            .worker_log(worker)
            .contains("the Step's task was taken from its flow; the Step was stopped")
        {
            stopped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(stopped, "{}", stack.worker_log(worker));
    assert!(ended < Duration::from_secs(30));
    next_turn_sees_the_note(&sessions).await;
    assert_eq!(stack.invocations().count("model"), 1, "never retried");
}

async fn a_cancel_during_a_model_call_stops_it_at_once_and_ends_the_turn() {
    let mut stack = stack(
        json!([
            {"steps": [{"gate": "model", "text": "too late"}]},
            {"steps": [{"text": "after"}]}
        ]),
        &[],
    );
    start(&mut stack);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "think long").await.unwrap();
    stack.gate("model").wait_until_reached().await;
    cancel(&stack, &["model"]).await;
    after_cancel(&sessions).await;
    assert_eq!(
        stack.invocations().count("model"),
        1,
        "the model call ran once"
    );
    next_turn_sees_the_note(&sessions).await;
    assert_eq!(
        stack.invocations().count("model"),
        1,
        "and was never retried"
    );
    // Nothing to cancel now.
    assert_eq!(
        sessions.cancel_turn("s1").await.unwrap(),
        CancelOutcome::NoTurn
    );
}

async fn a_cancel_during_parallel_tool_calls_stops_them_and_records_them_cancelled() {
    let mut stack = stack(
        json!([
            {"steps": [
                {"tool_calls": [
                    call("a", "gate", json!({"name": "a", "timeout_ms": 30000})),
                    call("b", "gate", json!({"name": "b", "timeout_ms": 30000}))
                ]},
                {"text": "never"}
            ]},
            {"steps": [{"text": "after"}]}
        ]),
        &[("gate", ToolEffect::Read, None)],
    );
    start(&mut stack);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "read both").await.unwrap();
    stack.gate("a").wait_until_reached().await;
    stack.gate("b").wait_until_reached().await;
    cancel(&stack, &["a", "b"]).await;
    let snapshot = after_cancel(&sessions).await;
    let note = snapshot
        .messages
        .last()
        .and_then(|m| m.text.clone())
        .unwrap();
    assert!(note.contains("gate"), "the note lists the calls: {note}");
    let mut statuses = finished(&sessions).await;
    statuses.sort();
    assert_eq!(
        statuses,
        vec![
            ("a".to_string(), "cancelled".to_string()),
            ("b".to_string(), "cancelled".to_string())
        ]
    );
    assert_eq!(stack.invocations().count("a"), 1);
    assert_eq!(stack.invocations().count("b"), 1);
    next_turn_sees_the_note(&sessions).await;
    assert_eq!(stack.invocations().count("a"), 1, "nothing ran twice");
    assert_eq!(stack.invocations().count("b"), 1, "nothing ran twice");
}

async fn a_cancel_during_an_approval_wait_runs_nothing_and_clears_the_approval() {
    let mut stack = stack(
        json!([
            {"steps": [
                {"tool_calls": [call("pay", "log", json!({"name": "pay"}))]},
                {"text": "never"}
            ]},
            {"steps": [{"text": "after"}]}
        ]),
        &[("log", ToolEffect::NonIdempotentWrite, None)],
    );
    start(&mut stack);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "pay").await.unwrap();
    let interrupt = wait_for_agent_snapshot(&sessions, "s1", "the approval", |s| {
        s.pending_interrupts.first().cloned()
    })
    .await;
    cancel(&stack, &[]).await;
    after_cancel(&sessions).await;
    assert_eq!(
        finished(&sessions).await,
        vec![("pay".to_string(), "cancelled".to_string())]
    );
    let late = sessions
        .resolve_interrupt(
            "s1",
            dexa::session::ResolveInterruptRequest {
                interrupt_id: interrupt.interrupt_id,
                approved: true,
                rejection_message: None,
            },
        )
        .await
        .unwrap();
    assert!(!late, "an approval of a cancelled turn resolves nothing");
    next_turn_sees_the_note(&sessions).await;
    assert_eq!(stack.invocations().count("pay"), 0, "the write never ran");
}

async fn a_cancel_with_a_single_attempt_write_in_flight_records_its_outcome_unknown() {
    let mut stack = stack(
        json!([
            {"steps": [
                {"tool_calls": [call("w", "gate", json!({"name": "w", "timeout_ms": 30000}))]},
                {"text": "never"}
            ]},
            {"steps": [{"text": "after"}]}
        ]),
        &[("gate", ToolEffect::NonIdempotentWrite, Some(false))],
    );
    start(&mut stack);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "write").await.unwrap();
    stack.gate("w").wait_until_reached().await;
    cancel(&stack, &["w"]).await;
    let snapshot = after_cancel(&sessions).await;
    let note = snapshot
        .messages
        .last()
        .and_then(|m| m.text.clone())
        .unwrap();
    assert!(note.contains("outcome_unknown"), "{note}");
    assert_eq!(
        finished(&sessions).await,
        vec![("w".to_string(), "outcome_unknown".to_string())]
    );
    next_turn_sees_the_note(&sessions).await;
    assert_eq!(stack.invocations().count("w"), 1, "the write ran once");
}

async fn a_steering_message_starts_the_next_turn_and_no_message_is_lost() {
    let mut stack = stack(
        json!([
            {"steps": [{"gate": "model", "text": "too late"}]},
            {"steps": [{"text": "steered"}]},
            {"steps": [{"text": "queued answer"}]}
        ]),
        &[],
    );
    start(&mut stack);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate("model").wait_until_reached().await;
    assert!(sessions.send_user_message("s1", "queued").await.unwrap());
    let sent = sessions
        .send_tracked("s1", "do this instead", None, true)
        .await
        .unwrap();
    assert_eq!(sent.interrupted.as_deref(), Some("turn-1"));
    tokio::time::sleep(INTERRUPT_WITHIN).await;
    stack.gate("model").release();
    let snapshot = wait_for_turns(&sessions, "s1", 3).await;
    assert!(
        !stack.gates_dir().join("model.passed").exists(),
        "the model call was stopped"
    );
    let texts: Vec<(MessageRole, String)> = snapshot
        .messages
        .iter()
        .map(|m| (m.role, m.text.clone().unwrap_or_default()))
        .collect();
    let users: Vec<&str> = texts
        .iter()
        .filter(|(r, _)| *r == MessageRole::User)
        .map(|(_, t)| t.as_str())
        .collect();
    assert_eq!(users.len(), 4, "{texts:?}");
    assert_eq!(users[0], "go");
    assert!(users[1].starts_with("[Dex] The user cancelled the previous turn"));
    assert_eq!(&users[2..], ["do this instead", "queued"]);
    assert_eq!(
        texts_of(&snapshot, MessageRole::Assistant),
        vec!["steered", "queued answer"]
    );
    let started = events_of(&sessions, event_type::TURN_STARTED).await;
    assert_eq!(
        started[1].data["message_id"],
        json!(sent.message_id),
        "the steering message started turn 2"
    );
    assert_eq!(stack.invocations().count("model"), 1, "nothing ran twice");
}

/// With no worker to run the pending CancelTurn: a second cancel writes
/// nothing, steers gather on it up to the cap (the next is refused, typed,
/// and queues nothing), and once a worker comes every one of them is used:
/// the first starts the next turn, the rest follow in order.
async fn steers_gather_on_a_pending_cancel_up_to_a_cap_and_none_is_lost() {
    let mut stack = stack(
        json!([
            {"steps": [{"gate": "model", "text": "too late"}]},
            {"steps": [{"text": "answer"}]}
        ]),
        &[],
    );
    let first = start(&mut stack);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    stack.gate("model").wait_until_reached().await;
    stack.kill_worker(first);
    let cancelled = CancelOutcome::Cancelled {
        turn_id: "turn-1".into(),
    };
    assert_eq!(sessions.cancel_turn("s1").await.unwrap(), cancelled);
    assert_eq!(sessions.cancel_turn("s1").await.unwrap(), cancelled);
    assert_eq!(
        events_of(&sessions, event_type::TURN_CANCEL_REQUESTED)
            .await
            .len(),
        1,
        "a cancel under way is not asked for again"
    );
    let cap = dexa::session::MAX_PENDING_STEERS;
    for n in 0..cap {
        let sent = sessions
            .send_tracked("s1", &format!("steer {n}"), None, true)
            .await
            .unwrap();
        assert_eq!(sent.interrupted.as_deref(), Some("turn-1"));
    }
    let refused = sessions
        .send_tracked("s1", "one too many", None, true)
        .await;
    assert!(
        matches!(
            refused,
            Err(dexa::session::SessionError::SteersPending { .. })
        ),
        "{refused:?}"
    );
    start(&mut stack);
    let snapshot = wait_for_turns(&sessions, "s1", 1 + cap as u64).await;
    let users = texts_of(&snapshot, MessageRole::User);
    let expected: Vec<String> = (0..cap).map(|n| format!("steer {n}")).collect();
    assert_eq!(users[0], "go");
    assert!(users[1].starts_with("[Dex] The user cancelled the previous turn"));
    assert_eq!(&users[2..], expected.as_slice(), "every steer, in order");
    assert_eq!(snapshot.queued_message_count, 0);
}

/// A cancel that names a turn leaves the next one alone: a cancel meant for
/// a turn that ended (sent late, or a retry) does not use up the queued
/// message the next turn runs.
async fn a_cancel_that_names_an_ended_turn_leaves_the_next_turn_alone() {
    let mut stack = stack(
        json!([
            {"steps": [{"text": "first"}]},
            {"steps": [{"gate": "model", "text": "second"}]}
        ]),
        &[],
    );
    start(&mut stack);
    let sessions = stack.sessions(AGENT);
    sessions.start_session("s1", "go").await.unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    assert!(sessions.send_user_message("s1", "next").await.unwrap());
    stack.gate("model").wait_until_reached().await;
    assert_eq!(
        sessions.cancel_named_turn("s1", "turn-1").await.unwrap(),
        CancelOutcome::NotThatTurn {
            running: "turn-2".into()
        }
    );
    assert!(
        events_of(&sessions, event_type::TURN_CANCEL_REQUESTED)
            .await
            .is_empty(),
        "nothing was cancelled"
    );
    stack.gate("model").release();
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(
        texts_of(&snapshot, MessageRole::Assistant),
        vec!["first", "second"]
    );
    assert_eq!(
        sessions.cancel_named_turn("s1", "turn-2").await.unwrap(),
        CancelOutcome::NoTurn
    );
}

macro_rules! backends {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::BACKEND.scope(super::Backend::Sqlite, super::$test()).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::BACKEND.scope(super::Backend::Postgres, super::$test()).await;
                }
            )*
        }
    };
}

backends!(
    a_cancel_during_a_model_call_that_sleeps_30_s_stops_it_and_ends_the_turn,
    a_cancel_during_a_model_call_stops_it_at_once_and_ends_the_turn,
    a_cancel_during_parallel_tool_calls_stops_them_and_records_them_cancelled,
    a_cancel_during_an_approval_wait_runs_nothing_and_clears_the_approval,
    a_cancel_with_a_single_attempt_write_in_flight_records_its_outcome_unknown,
    a_steering_message_starts_the_next_turn_and_no_message_is_lost,
    steers_gather_on_a_pending_cancel_up_to_a_cap_and_none_is_lost,
    a_cancel_that_names_an_ended_turn_leaves_the_next_turn_alone,
);
