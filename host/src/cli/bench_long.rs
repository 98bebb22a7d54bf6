//! `dexa bench turn --history N`: the same turn on a session that already
//! holds N messages and on a fresh one, alternating, so that both see the
//! same machine. The runner reads a 50-message window through its history
//! handle, so neither RunModel's host time nor the bytes handed to the
//! guest should grow with N. The figures come from each RunModel's
//! `usage_recorded` event (`context`), and the turn latency as in the
//! sequential run.

use std::time::Duration;

use super::bench::{micros, percentile};
use super::bench_turn::Bench;
use crate::session::{event_type, ImportedMessage, MessageRole, MAX_IMPORTED_MESSAGES};

/// What RunModel reported for the turns of one session.
#[derive(Default)]
struct RunModelFigures {
    host: Vec<Duration>,
    bytes: Vec<u64>,
    messages_read: Vec<u64>,
}

/// Fills `session_id` (idle) up to `total` messages, as a chat would:
/// user and assistant messages of about 200 bytes.
pub(super) async fn fill(bench: &Bench, session_id: &str, total: u64) -> anyhow::Result<()> {
    let mut count = bench
        .sessions
        .get_agent_snapshot(session_id)
        .await?
        .state
        .map_or(0, |s| s.message_count);
    while count < total {
        let batch = (total - count).min(MAX_IMPORTED_MESSAGES as u64);
        let messages = (0..batch)
            .map(|i| {
                let n = count + i + 1;
                let (role, text) = if n % 2 == 1 {
                    (MessageRole::User, format!("message {n}: what is the status of order {n}, and when does it ship?"))
                } else {
                    (MessageRole::Assistant, format!("message {n}: order {n} is packed and ships tomorrow morning by the usual carrier."))
                };
                ImportedMessage {
                    role,
                    framework_item: serde_json::json!({"type": "text", "text": text}).to_string(),
                    text: Some(text),
                }
            })
            .collect();
        count = bench
            .sessions
            .import_messages(session_id, count, messages)
            .await?;
    }
    Ok(())
}

async fn run_model_figures(bench: &Bench, session_id: &str) -> anyhow::Result<RunModelFigures> {
    let mut figures = RunModelFigures::default();
    let mut after = 0;
    loop {
        let (events, _) = bench.sessions.read_events(session_id, after, 1000).await?;
        let Some(last) = events.last().map(|(seq, _)| *seq) else {
            return Ok(figures);
        };
        after = last;
        for (_, event) in events {
            if event.event_type != event_type::USAGE_RECORDED {
                continue;
            }
            let context = &event.data["context"];
            if let Some(host) = context["host_micros"].as_u64() {
                figures.host.push(Duration::from_micros(host));
            }
            if let Some(bytes) = context["guest_input_bytes"].as_u64() {
                figures.bytes.push(bytes);
            }
            if let Some(read) = context["messages_read"].as_u64() {
                figures.messages_read.push(read);
            }
        }
    }
}

fn median(values: &mut [u64]) -> u64 {
    values.sort_unstable();
    values.get(values.len() / 2).copied().unwrap_or(0)
}

/// Runs `turns` turns on each of a fresh session and one of `history`
/// messages, alternating, and prints both.
pub(super) async fn run(
    bench: &Bench,
    label: &str,
    history: u64,
    turns: usize,
) -> anyhow::Result<f64> {
    let (fresh, long) = ("history-fresh", "history-long");
    for id in [fresh, long] {
        bench.sessions.start_session(id, "").await?;
        bench.turn(id, 1).await?;
    }
    eprintln!("bench turn [{label}]: filling a session with {history} messages");
    fill(bench, long, history).await?;
    let (mut fresh_times, mut long_times) = (Vec::new(), Vec::new());
    for turn in 2..=(turns as u64 + 1) {
        fresh_times.push(bench.turn(fresh, turn).await?);
        long_times.push(bench.turn(long, turn).await?);
    }
    fresh_times.sort();
    long_times.sort();
    let ratio = percentile(&long_times, 0.5).as_secs_f64()
        / percentile(&fresh_times, 0.5).as_secs_f64().max(1e-9);
    println!(
        "turn[{label}]/history: {turns} turns each; fresh session p50 {} p99 {}; {history}-message session p50 {} p99 {} ({ratio:.2}x)",
        micros(percentile(&fresh_times, 0.5)),
        micros(percentile(&fresh_times, 0.99)),
        micros(percentile(&long_times, 0.5)),
        micros(percentile(&long_times, 0.99)),
    );
    for (name, id) in [("fresh", fresh), ("long", long)] {
        let mut figures = run_model_figures(bench, id).await?;
        figures.host.sort();
        println!(
            "turn[{label}]/history/{name}: RunModel host time p50 {} p99 {}; bytes handed to the guest p50 {}; messages read p50 {} (over {} RunModel Steps)",
            micros(percentile(&figures.host, 0.5)),
            micros(percentile(&figures.host, 0.99)),
            median(&mut figures.bytes),
            median(&mut figures.messages_read),
            figures.host.len()
        );
    }
    Ok(ratio)
}
