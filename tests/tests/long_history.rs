//! Long sessions: the runner reads the history through a handle, a page at
//! a time, so a turn of a session with 10,000 messages hands the guest what
//! its window needs and no more; runners compact the history and later turns
//! start from the summary, while every message stays stored and listable.
//!
//! The host time of RunModel at 10 and at 10,000 messages is a benchmark
//! figure: `dexa bench turn --history 10000` (see the README).

use std::sync::Arc;

use dexa::plugin::wit::MessageRole as WitRole;
use dexa::providers::ScriptedModelProvider;
use dexa::session::*;
use dexa_tests::session::{
    all_events, last_text, text_answer, wait_for_agent_snapshot, wait_for_turns, AgentSpec,
    SessionStack,
};
use serde_json::Value;

async fn started(agents: Vec<AgentSpec>) -> SessionStack {
    let mut stack = SessionStack::new(agents).await;
    stack.start_worker();
    stack
}

/// Chat-shaped messages of about 100 bytes, alternating user and assistant.
fn chat_messages(from: u64, count: u64) -> Vec<ImportedMessage> {
    (from..from + count)
        .map(|n| {
            let (role, text) = if n % 2 == 1 {
                (
                    MessageRole::User,
                    format!("message {n}: where is order {n}?"),
                )
            } else {
                (
                    MessageRole::Assistant,
                    format!("message {n}: order {n} ships tomorrow."),
                )
            };
            ImportedMessage {
                role,
                framework_item: serde_json::json!({"type": "text", "text": text}).to_string(),
                text: Some(text),
            }
        })
        .collect()
}

/// Imports messages until the session holds `total`.
async fn fill(sessions: &AgentSessionClient, id: &str, total: u64) {
    let mut count = sessions
        .get_agent_snapshot(id)
        .await
        .unwrap()
        .state
        .unwrap()
        .message_count;
    while count < total {
        let batch = (total - count).min(MAX_IMPORTED_MESSAGES as u64);
        count = sessions
            .import_messages(id, count, chat_messages(count + 1, batch))
            .await
            .unwrap_or_else(|err| panic!("import: {err}"));
    }
    assert_eq!(count, total);
}

/// The `context` figures of the session's last RunModel.
async fn last_context(sessions: &AgentSessionClient, id: &str) -> Value {
    all_events(sessions, id)
        .await
        .into_iter()
        .rev()
        .find(|e| e.event_type == event_type::USAGE_RECORDED)
        .map(|e| e.data["context"].clone())
        .unwrap_or_else(|| panic!("{id}: no usage_recorded event"))
}

async fn a_turn_of_a_10000_message_session_hands_the_guest_its_window_not_the_history() {
    let stack = started(vec![
        AgentSpec::scripted("Window").runner_config("history_window", "50")
    ])
    .await;
    let sessions = stack.sessions("Window");
    let mut contexts = Vec::new();
    for (id, total) in [("short", 10u64), ("medium", 60), ("long", 10_000)] {
        sessions.start_session(id, "hello").await.unwrap();
        wait_for_turns(&sessions, id, 1).await;
        fill(&sessions, id, total).await;
        assert!(sessions
            .send_user_message(id, "how are things?")
            .await
            .unwrap());
        let snapshot = wait_for_turns(&sessions, id, 2).await;
        assert_eq!(
            last_text(&snapshot).as_deref(),
            Some("echo: how are things?")
        );
        assert_eq!(snapshot.state.unwrap().message_count, total + 2);
        let context = last_context(&sessions, id).await;
        println!("{id} ({total} messages before the turn): {context}");
        contexts.push(context);
    }
    let read = |c: &Value| c["messages_read"].as_u64().unwrap();
    let bytes = |c: &Value| c["guest_input_bytes"].as_u64().unwrap();
    let reads = |c: &Value| c["history_reads"].as_u64().unwrap();
    let (short, medium, long) = (&contexts[0], &contexts[1], &contexts[2]);
    // The short session's window is all of it: 10 messages and the turn's.
    assert_eq!(read(short), 11);
    assert_eq!(read(medium), 50);
    assert_eq!(read(long), 50, "the window, not 10,001 messages");
    assert_eq!(reads(long), 1, "one page");
    // Same window, same bytes, at 60 and at 10,000 messages (the message
    // numbers in the text are a few digits longer).
    assert!(
        bytes(long) <= bytes(medium) * 11 / 10,
        "10,000 messages: {} bytes; 60 messages: {} bytes",
        bytes(long),
        bytes(medium)
    );
    // Against the 10-message session the window holds 50 messages rather
    // than 11, so the bytes are about 5x; what grows is the window, never the
    // history: 9,940 more messages than `medium` add nothing.
    println!(
        "bytes handed to the guest: 10,000 messages / 10 messages = {:.2}; / 60 messages = {:.2}",
        bytes(long) as f64 / bytes(short) as f64,
        bytes(long) as f64 / bytes(medium) as f64
    );
    // Every message stays listable, in order.
    let mut listed = 0u64;
    let mut after = None;
    loop {
        let page = sessions
            .list_agent_messages(
                "long",
                ListAgentMessagesRequest {
                    after_sequence: after,
                    limit: 200,
                },
            )
            .await
            .unwrap();
        for message in &page.messages {
            listed += 1;
            assert_eq!(message.sequence, listed);
        }
        match page.next_after_sequence {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(listed, 10_002);
}

async fn an_import_needs_an_idle_session_and_writes_all_or_nothing() {
    let stack = started(vec![AgentSpec::scripted("Import")]).await;
    let sessions = stack.sessions("Import");
    // A model call of 8 s: the turn still runs when the import comes, even on
    // a busy machine.
    let slow = serde_json::json!({"steps": [{"sleep_ms": 8000, "text": "done"}]}).to_string();
    sessions.start_session("s1", &slow).await.unwrap();
    wait_for_agent_snapshot(&sessions, "s1", "the turn running", |s| {
        s.state.as_ref()?.active_turn_id.as_ref().map(|_| ())
    })
    .await;
    // A turn runs: refused, nothing written.
    let busy = sessions.import_messages("s1", 1, chat_messages(1, 2)).await;
    assert!(matches!(busy, Err(SessionError::Busy { .. })), "{busy:?}");
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    let before = snapshot.state.unwrap().message_count;
    // Too many, or one too large: refused whole.
    let many = sessions
        .import_messages(
            "s1",
            before,
            chat_messages(1, MAX_IMPORTED_MESSAGES as u64 + 1),
        )
        .await;
    assert!(matches!(many, Err(SessionError::Invalid(_))), "{many:?}");
    let mut huge = chat_messages(1, 3);
    huge[2].text = Some("x".repeat(MAX_IMPORTED_MESSAGE_BYTES + 1));
    let huge = sessions.import_messages("s1", before, huge).await;
    assert!(matches!(huge, Err(SessionError::Invalid(_))), "{huge:?}");
    // Many messages, each under its own cap, over the import's.
    let per = MAX_IMPORTED_MESSAGE_BYTES / 2;
    let mut bulk = chat_messages(1, (MAX_IMPORT_BYTES / per) as u64 + 1);
    for message in &mut bulk {
        message.text = Some("y".repeat(per));
    }
    let bulk = sessions.import_messages("s1", before, bulk).await;
    assert!(matches!(bulk, Err(SessionError::Invalid(_))), "{bulk:?}");
    let none = sessions
        .import_messages("nobody", 0, chat_messages(1, 1))
        .await;
    assert!(
        matches!(none, Err(SessionError::NoSuchSession(_))),
        "{none:?}"
    );
    let snapshot = sessions.get_agent_snapshot("s1").await.unwrap();
    assert_eq!(snapshot.state.unwrap().message_count, before);
    // Idle: imported, and the next turn follows them.
    let count = sessions
        .import_messages("s1", before, chat_messages(1, 2))
        .await
        .unwrap();
    assert_eq!(count, before + 2);
    // The same import retried (its answer lost) adds nothing.
    let again = sessions
        .import_messages("s1", before, chat_messages(1, 2))
        .await;
    assert!(matches!(again, Err(SessionError::Busy { .. })), "{again:?}");
    assert!(sessions.send_user_message("s1", "next").await.unwrap());
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    let sequences: Vec<u64> = snapshot.messages.iter().map(|m| m.sequence).collect();
    let mut sorted = sequences.clone();
    sorted.dedup();
    assert_eq!(sequences, sorted, "no sequence is used twice");
    assert_eq!(snapshot.state.unwrap().message_count, before + 4);
}

/// The chat runner of `guest` compacts past `compact_after` messages: the
/// turn's first model call writes the summary, later prompts start from it,
/// and the history stays whole.
async fn chat_runner_compacts(guest: &str) {
    let responses = ["a1", "a2", "S1", "a3", "a4", "S2", "a5"].map(text_answer);
    let model = Arc::new(ScriptedModelProvider::new(responses));
    let mut agent = AgentSpec::scripted("Chat")
        .runner_config("compact_after", "4")
        .runner_config("compact_keep", "2")
        .model(model.clone());
    agent.runner = guest.to_string();
    let stack = started(vec![agent]).await;
    let sessions = stack.sessions("Chat");
    sessions.start_session("s1", "one").await.unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    for (n, text) in ["two", "three", "four", "five"].iter().enumerate() {
        assert!(sessions.send_user_message("s1", text).await.unwrap());
        wait_for_turns(&sessions, "s1", n as u64 + 2).await;
    }
    let snapshot = sessions.get_agent_snapshot("s1").await.unwrap();
    assert_eq!(
        snapshot.state.as_ref().unwrap().last_turn_error,
        None,
        "{guest}"
    );
    assert_eq!(last_text(&snapshot).as_deref(), Some("a5"), "{guest}");
    assert_eq!(
        snapshot.usage.model_calls, 7,
        "{guest}: 5 answers, 2 summaries"
    );

    let requests = model.requests();
    assert_eq!(requests.len(), 7, "{guest}");
    let content = |r: usize, m: usize| requests[r].messages[m].content.clone().unwrap_or_default();
    // Turn 3 began with 5 messages, over 4: a summary of messages 1..=3.
    assert_eq!(requests[2].message_count, 1, "{guest}: the summary request");
    assert!(
        content(2, 0).contains("user: one"),
        "{guest}: {}",
        content(2, 0)
    );
    assert!(
        !content(2, 0).contains("three"),
        "{guest}: the kept messages stay out"
    );
    // Its answer starts from the summary: messages 4 (a2) and 5 (three).
    assert_eq!(requests[3].message_count, 3, "{guest}: {:?}", requests[3]);
    assert_eq!(requests[3].messages[0].role, WitRole::System);
    assert!(content(3, 0).contains("through message 3") && content(3, 0).contains("S1"));
    assert_eq!(content(3, 1), "a2");
    assert_eq!(content(3, 2), "three");
    // Turn 5 began with 9 messages, 6 after the summary: the new summary
    // carries the earlier one, and the answer starts from it.
    assert!(content(5, 0).contains("S1") && content(5, 0).contains("user: four"));
    assert!(content(6, 0).contains("through message 7") && content(6, 0).contains("S2"));
    assert_eq!(requests[6].message_count, 3, "{guest}: {:?}", requests[6]);

    let compacted: Vec<u64> = all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::HISTORY_COMPACTED)
        .map(|e| e.data["through_sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(compacted, vec![3, 7], "{guest}");
    // The history is whole: ten messages, none replaced by a summary.
    let page = sessions
        .list_agent_messages(
            "s1",
            ListAgentMessagesRequest {
                after_sequence: None,
                limit: 200,
            },
        )
        .await
        .unwrap();
    let texts: Vec<&str> = page
        .messages
        .iter()
        .map(|m| m.text.as_deref().unwrap_or_default())
        .collect();
    assert_eq!(
        texts,
        ["one", "a1", "two", "a2", "three", "a3", "four", "a4", "five", "a5"],
        "{guest}"
    );
}

async fn the_rust_chat_runner_compacts_and_later_turns_start_from_the_summary() {
    chat_runner_compacts("chat-runner").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_chat_runner_compacts_and_later_turns_start_from_the_summary() {
    chat_runner_compacts("py-runner").await;
}

async fn a_scripted_compaction_is_stored_and_the_turn_goes_on_from_it() {
    let stack = started(vec![AgentSpec::scripted("Scripted")]).await;
    let sessions = stack.sessions("Scripted");
    sessions.start_session("s1", "first").await.unwrap();
    wait_for_turns(&sessions, "s1", 1).await;
    let script = serde_json::json!({"steps": [
        {"compact": {"keep": 1, "summary": "they said first"}},
        {"model": false, "text": "after the summary"}
    ]})
    .to_string();
    assert!(sessions.send_user_message("s1", &script).await.unwrap());
    let snapshot = wait_for_turns(&sessions, "s1", 2).await;
    assert_eq!(snapshot.state.as_ref().unwrap().last_turn_error, None);
    assert_eq!(last_text(&snapshot).as_deref(), Some("after the summary"));
    let events = all_events(&sessions, "s1").await;
    let compacted: Vec<&AgentEvent> = events
        .iter()
        .filter(|e| e.event_type == event_type::HISTORY_COMPACTED)
        .collect();
    assert_eq!(compacted.len(), 1);
    assert_eq!(compacted[0].turn_id, "turn-2");
    assert_eq!(compacted[0].data["through_sequence"], 2);
}

// Each test on SQLite and on PostgreSQL (`DEXA_TEST_POSTGRES`).
dexa_tests::on_each_backend!(
    a_turn_of_a_10000_message_session_hands_the_guest_its_window_not_the_history,
    an_import_needs_an_idle_session_and_writes_all_or_nothing,
    the_rust_chat_runner_compacts_and_later_turns_start_from_the_summary,
    a_scripted_compaction_is_stored_and_the_turn_goes_on_from_it,
);

/// A runner that reads the history in a loop is stopped at the call's byte
/// budget, before the page that passes it is copied into the guest, and the
/// store hands over at most the budget and one message per page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_read_stops_at_the_calls_byte_budget() {
    use dexa::plugin::wit::{AgentMessage, MessageRole as Role};
    use dexa::plugin::{CallEnv, ComponentSettings, MemoryHistory, TurnInput};
    let big = "h".repeat(256 << 10);
    let mut messages: Vec<AgentMessage> = (1..=300u64)
        .map(|sequence| AgentMessage {
            sequence,
            turn_id: "turn-1".to_string(),
            role: Role::Assistant,
            framework_item: big.clone(),
            text: None,
        })
        .collect();
    messages.push(AgentMessage {
        sequence: 301,
        turn_id: "turn-2".to_string(),
        role: Role::User,
        framework_item: "history-flood".to_string(),
        text: Some("history-flood".to_string()),
    });
    let engine = dexa_tests::test_engine();
    let runner = engine
        .load_runner(
            &dexa_tests::guest_bytes("hostile-runner"),
            ComponentSettings::named("hostile-runner"),
        )
        .unwrap_or_else(|err| panic!("{err}"));
    let turn = TurnInput {
        flow_id: "flow-1".to_string(),
        turn_id: "turn-2".to_string(),
        attempt: 1,
        history: MemoryHistory::shared(messages),
        compaction: None,
        framework_run_state: None,
        tool_calls: Vec::new(),
        tools: Vec::new(),
    };
    let env = CallEnv::new(dexa_tests::step_tag("flow-1", "turn-2", "step-1", 1));
    let err = match runner.run_model_step(env, turn).await {
        Err(err) => err.to_string(),
        Ok(outcome) => panic!("the flood ended: {outcome:?}"),
    };
    assert!(
        err.contains("history.read returned more than 67108864 bytes in one call"),
        "{err}"
    );
}
