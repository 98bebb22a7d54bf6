//! Many workers on many machines, on PostgreSQL: separate `dexa worker`
//! processes (two of them with wall clocks skewed by libfaketime when it is
//! installed) share one store and run a hundred sessions through SIGKILLs;
//! and `dexa serve --no-worker` serves the API while workers elsewhere run
//! the Steps, the session seen live over SSE.
//!
//! Both tests need `DEXA_TEST_POSTGRES` (`./ci.sh` starts a throwaway
//! cluster) and `target/debug/dexa` (`cargo build -p dexa`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use dexa::session::{
    event_type, AgentEvent, AgentSessionClient, AgentSnapshot, MessageRole, ToolEffect,
};
use dexa_tests::kit::{dexa_binary, AgentTestStack, KitAgent, KitSettings};
use dexa_tests::session::{texts_of, Backend, BACKEND};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::{json, Value};

const AGENT: &str = "Scale";

/// Debian's libfaketime (package `faketime`, which ci.sh installs).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// Sessions and turns of the first test.
const SESSIONS: usize = 100;
const TURNS: u64 = 3;
/// Worker slots: the most Steps a worker runs at once.
const SLOTS: usize = 24;
/// The first test kills two workers when this many turn-2 writes are held
/// at their gate (each in a slot until the release). Any three workers hold
/// at most `3 * SLOTS` (72) of them, so each of the four, the skewed ones
/// too, holds at least `KILL_AT - 3 * SLOTS` (18); and the killed two hold
/// at least `KILL_AT - 2 * SLOTS` (42) single-attempt writes that started
/// and never returned. By then at least 90 of the 300 turns are over.
const KILL_AT: usize = 90;
/// How long the whole run may take before the test fails (the machine is
/// slow; this is patience, not an expectation).
const PATIENCE: Duration = Duration::from_secs(300);

/// The write each turn makes: `log` (returns at once) in turns 1 and 3, and
/// in turn 2 `gate` `w2`, which holds every turn-2 write until the test
/// releases it after the kills. Both are non-idempotent writes without
/// approval: a single attempt each.
fn scale_agent() -> KitAgent {
    let turn = |n: u64, tool: &str, arguments: Value| {
        json!({"steps": [
            {"tool_calls": [{"id": "w", "name": tool, "arguments": arguments}]},
            {"text": format!("done {n}")}
        ]})
    };
    let script = json!({"turns": [
        turn(1, "log", json!({"name": "w1"})),
        turn(2, "gate", json!({"name": "w2", "timeout_ms": 240_000})),
        turn(3, "log", json!({"name": "w3"})),
    ]});
    KitAgent::scripted(AGENT, script)
        .tool("gate-tool")
        .policy("log", ToolEffect::NonIdempotentWrite, Some(false))
        .policy("gate", ToolEffect::NonIdempotentWrite, Some(false))
}

fn message(session: &str, turn: u64) -> String {
    format!("{session} says m{turn}")
}

/// Turns of the session that are over (completed or failed).
fn finished_turns(snapshot: &AgentSnapshot) -> u64 {
    snapshot.state.as_ref().map_or(0, |state| {
        state.turn_count - u64::from(state.active_turn_id.is_some())
    })
}

/// Whether `turns` turns are over and nothing is queued.
fn settled(snapshot: &AgentSnapshot, turns: u64) -> bool {
    snapshot
        .state
        .as_ref()
        .is_some_and(|state| state.turn_count >= turns && state.active_turn_id.is_none())
        && snapshot.queued_message_count == 0
}

/// Every event of the session with its stream sequence number.
async fn events_with_seq(sessions: &AgentSessionClient, session: &str) -> Vec<(i64, AgentEvent)> {
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let (page, _next) = sessions
            .read_events(session, after, 1000)
            .await
            .unwrap_or_else(|err| panic!("read events of {session}: {err}"));
        let Some((last, _)) = page.last() else {
            return events;
        };
        after = *last;
        events.extend(page);
    }
}

/// The environment of a worker whose wall clock is `offset` (`-45s`) off,
/// when libfaketime is installed; else none.
fn skewed_clock(offset: &str) -> Vec<(&'static str, String)> {
    if !Path::new(LIBFAKETIME).is_file() {
        return Vec::new();
    }
    vec![
        ("LD_PRELOAD", LIBFAKETIME.to_string()),
        ("FAKETIME", offset.to_string()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
    ]
}

fn as_refs<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    vars.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// The wall clock (seconds since the epoch) a process started with `env`
/// reads: `date +%s`.
fn wall_clock_with(env: &[(&str, String)]) -> i64 {
    let output = std::process::Command::new("date")
        .arg("+%s")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap_or_else(|err| panic!("run date: {err}"));
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|err| panic!("date printed {:?}: {err}", output.stdout))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_workers_on_one_postgres_run_a_hundred_sessions_through_kills() {
    BACKEND
        .scope(Backend::Postgres, four_workers_run_a_hundred_sessions())
        .await;
}

async fn four_workers_run_a_hundred_sessions() {
    // A killed worker's Steps are taken over 5 s after it died; a shorter
    // lease lapses now and then on a live worker of this loaded 2-core
    // machine, which is safe (such a write is outcome_unknown, never run
    // twice) but could fail a turn's model call three times.
    let mut stack = AgentTestStack::with_settings(
        vec![scale_agent()],
        KitSettings {
            slots: SLOTS,
            lease: Duration::from_secs(5),
        },
    );
    // Two of the four run with their wall clocks 45 s behind and 30 s ahead:
    // the store takes every time from the database, so that must not matter.
    // Without libfaketime all four run on the machine's clock.
    let behind = skewed_clock("-45s");
    let ahead = skewed_clock("+30s");
    let skewed = !behind.is_empty();
    if skewed {
        let now = wall_clock_with(&[]);
        let (b, a) = (
            wall_clock_with(&behind) - now,
            wall_clock_with(&ahead) - now,
        );
        assert!(
            (-50..=-40).contains(&b) && (25..=35).contains(&a),
            "libfaketime does not skew the clock as asked: {b} s and {a} s"
        );
    }
    let mut workers = vec![
        stack.start_worker(),
        stack.start_worker_with_env(&[], &as_refs(&behind)),
        stack.start_worker_with_env(&[], &as_refs(&ahead)),
        stack.start_worker(),
    ];
    let sessions = stack.sessions(AGENT);
    let log = stack.invocations();
    let ids: Vec<String> = (0..SESSIONS).map(|i| format!("s{i:03}")).collect();
    let started = Instant::now();
    for id in &ids {
        sessions.start_session(id, &message(id, 1)).await.unwrap();
    }

    // Each session's next message goes out once its previous turn is over.
    let mut sent: BTreeMap<&str, u64> = ids.iter().map(|id| (id.as_str(), 1)).collect();
    let mut snapshots: BTreeMap<&str, AgentSnapshot> = BTreeMap::new();
    let mut kill = None;
    loop {
        for id in &ids {
            if snapshots
                .get(id.as_str())
                .is_some_and(|s| settled(s, TURNS))
            {
                continue;
            }
            let Ok(snapshot) = sessions.get_agent_snapshot(id).await else {
                continue;
            };
            let count = sent.get_mut(id.as_str()).unwrap_or_else(|| unreachable!());
            if *count < TURNS && settled(&snapshot, *count) {
                *count += 1;
                assert!(sessions
                    .send_user_message(id, &message(id, *count))
                    .await
                    .unwrap());
            }
            snapshots.insert(id.as_str(), snapshot);
            // Every turn-2 write waits at gate w2 until the release here.
            let held = log.count("w2");
            if kill.is_none() && held >= KILL_AT {
                for index in [workers[0], workers[1]] {
                    assert!(
                        stack.worker(index).exit_status().is_none(),
                        "worker {index} exited before the kill:\n{}",
                        stack.worker_log(index)
                    );
                }
                stack.kill_worker(workers[0]);
                stack.kill_worker(workers[1]);
                stack.gate("w2").release();
                workers.push(stack.start_worker());
                let done: u64 = snapshots.values().map(finished_turns).sum();
                kill = Some((started.elapsed(), held, done));
            }
        }
        let done: u64 = snapshots.values().map(finished_turns).sum();
        let all_settled = ids.iter().all(|id| {
            snapshots
                .get(id.as_str())
                .is_some_and(|s| settled(s, TURNS))
        });
        if all_settled {
            break;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "after {:?}, {done} of {} turns were over (killed: {kill:?}; turn-2 writes at the gate: {})",
            started.elapsed(),
            SESSIONS as u64 * TURNS,
            log.count("w2"),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    let (killed_at, held_at_kill, done_at_kill) =
        kill.unwrap_or_else(|| panic!("the run ended before the kills"));

    // The workers that were not killed are still running.
    for index in [workers[2], workers[3], workers[4]] {
        assert!(
            stack.worker(index).exit_status().is_none(),
            "worker {index} exited:\n{}",
            stack.worker_log(index)
        );
    }

    // Every single-attempt write ran at most once.
    let mut runs: BTreeMap<String, usize> = BTreeMap::new();
    for (name, key) in log.entries() {
        *runs.entry(format!("{name} {key}")).or_default() += 1;
    }
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "single-attempt writes that ran twice: {twice:?}"
    );

    let mut outcome_unknown = BTreeMap::<u64, usize>::new();
    for id in &ids {
        let snapshot = &snapshots[id.as_str()];
        // Every user message exactly once, in order.
        let expected: Vec<String> = (1..=TURNS).map(|n| message(id, n)).collect();
        assert_eq!(
            texts_of(snapshot, MessageRole::User),
            expected,
            "{id}: user messages"
        );
        assert_eq!(
            snapshot.state.as_ref().map(|s| s.turn_count),
            Some(TURNS),
            "{id}"
        );
        let events = events_with_seq(&sessions, id).await;
        let seqs: Vec<i64> = events.iter().map(|(seq, _)| *seq).collect();
        assert!(
            seqs.windows(2).all(|w| w[1] == w[0] + 1),
            "{id}: event sequence {seqs:?}"
        );
        for n in 1..=TURNS {
            let turn_id = format!("turn-{n}");
            let of_turn = |kind: &str| -> Vec<&AgentEvent> {
                events
                    .iter()
                    .map(|(_, e)| e)
                    .filter(|e| e.turn_id == turn_id && e.event_type == kind)
                    .collect()
            };
            assert_eq!(
                (
                    of_turn(event_type::TURN_COMPLETED).len(),
                    of_turn(event_type::TURN_FAILED).len()
                ),
                (1, 0),
                "{id} {turn_id}: (completed, failed) events"
            );
            // One final record of the write; a write whose worker died
            // after it started is outcome_unknown, and ran at most once.
            let finished = of_turn(event_type::TOOL_CALL_FINISHED);
            let statuses: Vec<&str> = finished
                .iter()
                .map(|e| e.data["status"].as_str().unwrap_or_default())
                .collect();
            let key = format!("w{n} {id}/{turn_id}/w");
            let ran = runs.get(&key).copied().unwrap_or(0);
            match statuses.as_slice() {
                ["succeeded"] => assert_eq!(ran, 1, "{key} succeeded"),
                ["outcome_unknown"] => {
                    assert!(ran <= 1, "{key}");
                    *outcome_unknown.entry(n).or_default() += 1;
                }
                other => panic!("{id} {turn_id}: the write finished as {other:?}"),
            }
        }
        let answers: Vec<String> = texts_of(snapshot, MessageRole::Assistant);
        assert_eq!(answers, vec!["done 1", "done 2", "done 3"], "{id}");
    }
    // The killed workers held at least this many started turn-2 writes.
    let unknown_2 = outcome_unknown.get(&2).copied().unwrap_or(0);
    assert!(
        unknown_2 >= held_at_kill - 2 * SLOTS,
        "{held_at_kill} turn-2 writes were held at the kill, the survivors can hold {}, \
         yet only {unknown_2} are outcome_unknown",
        2 * SLOTS
    );
    println!(
        "scale out: {SESSIONS} sessions x {TURNS} turns on 4 workers ({}) in {:.1} s; \
         killed 2 at {:.1} s, when {done_at_kill} turns were over and {held_at_kill} turn-2 writes held, 1 replacement; \
         {} single-attempt writes ran, none twice; outcome_unknown by turn: {outcome_unknown:?}",
        if skewed { "two with clocks 45 s behind and 30 s ahead" } else { "libfaketime missing: no skew" },
        elapsed.as_secs_f64(),
        killed_at.as_secs_f64(),
        runs.len(),
    );
}

/// A `dexa serve --no-worker` process on the stack's config.
struct Serve {
    base: String,
    child: tokio::process::Child,
    stderr: PathBuf,
}

const TOKEN: &str = "scale-out-token";

impl Serve {
    async fn start(stack: &AgentTestStack) -> Self {
        let stderr = stack.dir.path().join("serve.log");
        let file = std::fs::File::create(&stderr).unwrap_or_else(|err| panic!("serve log: {err}"));
        let mut command = tokio::process::Command::new(dexa_binary());
        command
            .args([
                "serve",
                "--no-worker",
                "--listen",
                "127.0.0.1:0",
                "--config",
            ])
            .arg(&stack.config_path)
            .env("DEXA_API_TOKEN", TOKEN)
            .env("RUST_LOG", "warn,dexa::cli::serve=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe; the server dies with the test.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {}: {err}", dexa_binary().display()));
        let started = Instant::now();
        loop {
            let printed = std::fs::read_to_string(&stderr).unwrap_or_default();
            if let Some(address) = printed
                .split("dexa serve: http://")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
            {
                return Self {
                    base: format!("http://{address}"),
                    child,
                    stderr,
                };
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("dexa serve exited with {status} before listening:\n{printed}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "dexa serve did not listen within 60 s:\n{printed}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn printed(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
}

/// One SSE event: (id, event name, data).
type Seen = (i64, String, Value);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dexa_serve_without_a_worker_and_workers_elsewhere_complete_a_session_seen_over_sse() {
    BACKEND
        .scope(
            Backend::Postgres,
            serve_without_a_worker_and_workers_elsewhere(),
        )
        .await;
}

async fn serve_without_a_worker_and_workers_elsewhere() {
    let script = json!({"turns": [{"steps": [
        {"text": "Writing.", "tool_calls": [
            {"id": "w", "name": "log", "arguments": {"name": "w", "hold_ms": 300}}
        ]},
        {"text": "written", "deltas": ["writ", "ten"]}
    ]}]});
    let mut stack = AgentTestStack::new(vec![KitAgent::scripted(AGENT, script)
        .tool("gate-tool")
        .policy("log", ToolEffect::NonIdempotentWrite, Some(false))]);
    let mut serve = Serve::start(&stack).await;
    assert!(
        serve.printed().contains("no worker (run dexa worker)"),
        "{}",
        serve.printed()
    );
    let workers = [stack.start_worker(), stack.start_worker()];
    let http = reqwest::Client::new();
    let url = |path: &str| format!("{}{path}", serve.base);

    // A session without a turn yet, its event stream opened, then the
    // message that starts the turn.
    let response = http
        .post(url(&format!("/v1/agents/{AGENT}/sessions")))
        .bearer_auth(TOKEN)
        .json(&json!({"session_id": "s1", "message": ""}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        StatusCode::CREATED,
        "{:?}",
        response.text().await
    );
    let response = http
        .get(url("/v1/sessions/s1/events"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut stream = response.bytes_stream().eventsource();
    let response = http
        .post(url("/v1/sessions/s1/messages"))
        .bearer_auth(TOKEN)
        .json(&json!({"text": "write it down"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        StatusCode::ACCEPTED,
        "{:?}",
        response.text().await
    );

    let mut seen: Vec<Seen> = Vec::new();
    let mut next = async |seen: &mut Vec<Seen>| {
        let event = tokio::time::timeout(Duration::from_secs(60), stream.next())
            .await
            .unwrap_or_else(|_| panic!("no event within 60 s; seen {seen:?}"))
            .unwrap_or_else(|| panic!("the stream ended; seen {seen:?}"))
            .unwrap_or_else(|err| panic!("a malformed event ({err}); seen {seen:?}"));
        let id: i64 = event
            .id
            .parse()
            .unwrap_or_else(|err| panic!("event id {:?}: {err}", event.id));
        let data: Value =
            serde_json::from_str(&event.data).unwrap_or_else(|err| panic!("{err}: {}", event.data));
        seen.push((id, event.event, data));
    };
    while !seen
        .iter()
        .any(|(_, kind, _)| kind == event_type::TURN_COMPLETED)
    {
        next(&mut seen).await;
    }

    // The session as the API shows it once the turn is over.
    let started = Instant::now();
    let snapshot = loop {
        let snapshot: Value = http
            .get(url("/v1/sessions/s1"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if snapshot["state"]["turn_count"] == 1 && snapshot["state"]["active_turn_id"].is_null() {
            break snapshot;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the turn never settled: {snapshot}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let texts: Vec<&str> = snapshot["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("{snapshot}"))
        .iter()
        .filter_map(|m| m["text"].as_str())
        .collect();
    assert_eq!(
        texts,
        vec!["write it down", "Writing.", "s1/turn-1/w", "written"]
    );

    // The store's events, read afterwards; the stream catches up to the last
    // of them (events written after turn_completed come after it).
    let stored = events_with_seq(&stack.sessions(AGENT), "s1").await;
    let last = stored
        .last()
        .map(|(seq, _)| *seq)
        .unwrap_or_else(|| panic!("no events stored"));
    while seen.last().is_some_and(|(id, _, _)| *id < last) {
        next(&mut seen).await;
    }
    let ids: Vec<i64> = seen.iter().map(|(id, _, _)| *id).collect();
    let stored_ids: Vec<i64> = stored.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(
        ids, stored_ids,
        "the stream saw every stored event once, in order"
    );
    assert_eq!(
        stored_ids,
        (1..=last).collect::<Vec<i64>>(),
        "the store's sequence has no gap"
    );
    for ((id, kind, data), (_, event)) in seen.iter().zip(&stored) {
        assert_eq!(kind, &event.event_type, "event {id}");
        assert_eq!(data, &serde_json::to_value(event).unwrap(), "event {id}");
    }
    let kinds: Vec<&str> = seen.iter().map(|(_, kind, _)| kind.as_str()).collect();
    for kind in [
        event_type::TURN_STARTED,
        event_type::TOOL_CALL_STARTED,
        event_type::TOOL_CALL_FINISHED,
        event_type::TURN_COMPLETED,
    ] {
        assert_eq!(
            kinds.iter().filter(|k| **k == kind).count(),
            1,
            "{kind} in {kinds:?}"
        );
    }
    let finished = seen
        .iter()
        .find(|(_, kind, _)| kind == event_type::TOOL_CALL_FINISHED)
        .map(|(_, _, data)| data["data"]["status"].clone());
    assert_eq!(finished, Some(json!("succeeded")));
    let deltas: String = seen
        .iter()
        .filter(|(_, kind, _)| kind == event_type::TEXT_DELTA)
        .filter_map(|(_, _, data)| data["data"]["text"].as_str())
        .collect();
    assert_eq!(deltas, "Writing.written");
    // The write ran once, in one of the workers: the server runs no Steps.
    assert_eq!(stack.invocations().keys("w"), vec!["s1/turn-1/w"]);
    for index in workers {
        assert!(
            stack.worker(index).exit_status().is_none(),
            "{}",
            stack.worker_log(index)
        );
    }
    assert!(
        serve.child.try_wait().unwrap().is_none(),
        "{}",
        serve.printed()
    );
}
