//! The soak run: many sessions of several turns with tools, served by two
//! `dexa worker` processes, one of which is SIGKILLed and replaced every few
//! seconds. Bounded to 5 minutes. Sizes: `DEXA_SOAK_SESSIONS` (200),
//! `DEXA_SOAK_TURNS` (3), `DEXA_SOAK_KILL_EVERY_MS` (2000).
//!
//! At the end every turn has completed or failed (with the turn-failure note
//! when it had tool calls), every single-attempt tool ran at most once, and no
//! user message was lost or duplicated. The figures are printed; run with
//! `cargo test -p dexa-tests --test soak -- --nocapture`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dexa::session::{event_type, AgentSnapshot, MessageRole, ToolEffect};
use dexa_tests::kit::{AgentTestStack, KitAgent, KitSettings};
use serde_json::json;

const AGENT: &str = "Soak";
const BOUND: Duration = Duration::from_secs(300);

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Whether every turn of the session is over.
fn settled(snapshot: &AgentSnapshot, turns: u64) -> bool {
    snapshot.state.as_ref().is_some_and(|state| {
        state.turn_count >= turns
            && state.active_turn_id.is_none()
            && snapshot.queued_message_count == 0
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_200_sessions_of_3_turns_with_a_worker_killed_every_few_seconds() {
    let sessions_n = env_number("DEXA_SOAK_SESSIONS", 200) as usize;
    let turns = env_number("DEXA_SOAK_TURNS", 3);
    let kill_every = Duration::from_millis(env_number("DEXA_SOAK_KILL_EVERY_MS", 2000));
    // Every turn: a model step that takes 1 s, then a read (retried when
    // lost) and a single-attempt write (never run twice) of 0.4 s each, then
    // the answer.
    let script = json!({"turns": [{"steps": [
        {"sleep_ms": 1000, "log": "model", "tool_calls": [
            {"id": "r", "name": "log", "arguments": {"name": "r", "hold_ms": 400}},
            {"id": "w", "name": "gate", "arguments": {"name": "w", "hold_ms": 400}}
        ]},
        {"text": "done"}
    ]}]});
    let mut stack = AgentTestStack::with_settings(
        vec![KitAgent::scripted(AGENT, script)
            .tool("gate-tool")
            .policy("log", ToolEffect::Read, None)
            .policy("gate", ToolEffect::NonIdempotentWrite, Some(false))],
        KitSettings {
            slots: 16,
            lease: Duration::from_secs(2),
        },
    );
    // Gate `w` is open from the start: the write returns at once.
    stack.gate("w").release();
    let mut alive = vec![stack.start_worker(), stack.start_worker()];
    let sessions = stack.sessions(AGENT);
    let started = Instant::now();
    let ids: Vec<String> = (0..sessions_n).map(|i| format!("soak-{i:03}")).collect();
    for id in &ids {
        sessions.start_session(id, "m1").await.unwrap();
        for n in 2..=turns {
            sessions
                .send_user_message(id, &format!("m{n}"))
                .await
                .unwrap();
        }
    }

    let mut kills = 0;
    let mut last_kill = Instant::now();
    let mut snapshots: BTreeMap<String, AgentSnapshot> = BTreeMap::new();
    loop {
        for id in &ids {
            if snapshots.get(id).is_some_and(|s| settled(s, turns)) {
                continue;
            }
            if let Ok(snapshot) = sessions.get_agent_snapshot(id).await {
                snapshots.insert(id.clone(), snapshot);
            }
        }
        let done = ids
            .iter()
            .filter(|id| snapshots.get(*id).is_some_and(|s| settled(s, turns)))
            .count();
        if done == ids.len() {
            break;
        }
        assert!(
            started.elapsed() < BOUND,
            "after {:?}, {done} of {} sessions had finished {turns} turns",
            started.elapsed(),
            ids.len()
        );
        if last_kill.elapsed() >= kill_every {
            let victim = alive.remove(0);
            stack.kill_worker(victim);
            kills += 1;
            alive.push(stack.start_worker());
            last_kill = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let elapsed = started.elapsed();

    // No user message lost or duplicated, and every turn is over.
    let mut completed = 0;
    let mut failed = 0;
    let mut failed_with_note = 0;
    let mut outcome_unknown = 0;
    for id in &ids {
        let snapshot = &snapshots[id];
        let users: Vec<String> = snapshot
            .messages
            .iter()
            .filter(|m| {
                m.role == MessageRole::User && !m.text.as_deref().unwrap_or("").starts_with("[Dex]")
            })
            .filter_map(|m| m.text.clone())
            .collect();
        let expected: Vec<String> = (1..=turns).map(|n| format!("m{n}")).collect();
        assert_eq!(users, expected, "{id}: user messages");
        let events = dexa_tests::session::all_events(&sessions, id).await;
        for n in 1..=turns {
            let turn_id = format!("turn-{n}");
            let of_turn = |kind: &str| {
                events
                    .iter()
                    .filter(|e| e.turn_id == turn_id && e.event_type == kind)
                    .count()
            };
            match (
                of_turn(event_type::TURN_COMPLETED),
                of_turn(event_type::TURN_FAILED),
            ) {
                (1, 0) => completed += 1,
                (0, 1) => {
                    failed += 1;
                    let noted = snapshot.messages.iter().any(|m| {
                        m.turn_id == turn_id
                            && m.text
                                .as_deref()
                                .is_some_and(|t| t.starts_with("[Dex] The previous turn failed"))
                    });
                    let had_tools = events.iter().any(|e| {
                        e.turn_id == turn_id && e.event_type == event_type::TOOL_CALL_FINISHED
                    });
                    assert!(
                        noted || !had_tools,
                        "{id} {turn_id} failed after tool calls without the note"
                    );
                    if noted {
                        failed_with_note += 1;
                    }
                }
                other => panic!("{id} {turn_id}: (completed, failed) events {other:?}"),
            }
        }
        outcome_unknown += events
            .iter()
            .filter(|e| {
                e.event_type == event_type::TOOL_CALL_FINISHED
                    && e.data["status"] == "outcome_unknown"
            })
            .count();
    }

    // Every single-attempt write ran at most once; reads may have run again.
    let log = stack.invocations();
    let mut writes: BTreeMap<String, usize> = BTreeMap::new();
    for key in log.keys("w") {
        *writes.entry(key).or_default() += 1;
    }
    let twice: Vec<_> = writes.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "single-attempt writes that ran twice: {twice:?}"
    );
    let reads = log.keys("r");
    let model_calls = log.keys("model");
    let distinct_reads: std::collections::BTreeSet<&String> = reads.iter().collect();
    let total_turns = sessions_n as u64 * turns;
    assert_eq!(completed + failed, total_turns);

    println!(
        "soak: {sessions_n} sessions x {turns} turns in {:.1} s with {kills} worker kills (every {:?}): \
         {completed} turns completed, {failed} failed ({failed_with_note} with the note); \
         single-attempt writes: {} ran, none twice, {outcome_unknown} outcome_unknown; \
         reads: {} calls for {} tool calls ({} ran again); first model steps: {} calls for {} turns",
        elapsed.as_secs_f64(),
        kill_every,
        writes.len(),
        reads.len(),
        distinct_reads.len(),
        reads.len() - distinct_reads.len(),
        model_calls.len(),
        total_turns,
    );
    assert!(
        kills > 0,
        "the run ended before any worker was killed; raise the session count"
    );
}
