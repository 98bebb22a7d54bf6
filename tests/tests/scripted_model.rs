//! The scripted model provider runs inside `dexa serve` and `dexa worker`
//! when a deployment configures it, and a runner decides how large each
//! request is: it must keep only a bounded summary of what it was sent.
//!
//! Rerun the measurement (prints the worker's peak RSS per turn):
//! `cargo build -p dexa && cargo test -p dexa-tests --test scripted_model -- --nocapture`;
//! against another binary, set `DEXA_BIN`.

use dexa::plugin::wit::{AgentMessage, MessageRole, TurnOutcome};
use dexa::plugin::{CallEnv, ComponentSettings};
use dexa::plugin::{MemoryHistory, TurnInput};
use dexa::providers::ScriptedModelProvider;
use dexa_tests::hostile::next_turn;
use dexa_tests::kit::{wait_for_turns, AgentTestStack};
use dexa_tests::measure::peak_rss_mib;
use dexa_tests::session::{last_text, text_answer};
use dexa_tests::{guest_bytes, guest_wasm, repo_root, step_tag, test_engine};
use std::sync::Arc;

const MIB: usize = 1 << 20;

/// hostile-runner's turn whose user message is `attack`.
fn attack_turn(turn_id: &str, attack: &str) -> TurnInput {
    TurnInput {
        flow_id: "flow-1".to_string(),
        turn_id: turn_id.to_string(),
        attempt: 1,
        history: MemoryHistory::shared(vec![AgentMessage {
            sequence: 1,
            turn_id: turn_id.to_string(),
            role: MessageRole::User,
            // hostile-runner reads its attack from the framework item.
            framework_item: attack.to_string(),
            text: Some(attack.to_string()),
        }]),
        compaction: None,
        framework_run_state: None,
        tool_calls: Vec::new(),
        tools: Vec::new(),
    }
}

#[tokio::test]
async fn the_scripted_model_holds_a_bounded_summary_however_many_and_large_the_requests() {
    let engine = test_engine();
    let runner = engine
        .load_runner(
            &guest_bytes("hostile-runner"),
            ComponentSettings::named("hostile-runner"),
        )
        .unwrap_or_else(|err| panic!("hostile-runner: {err}"));
    let model = Arc::new(ScriptedModelProvider::new([text_answer("noted")]).repeating());
    let (turns, mib) = (12, 8);
    for n in 1..=turns {
        let turn_id = format!("turn-{n}");
        let env = CallEnv::new(step_tag("flow-1", &turn_id, "step-1", 1)).with_model(model.clone());
        let outcome = runner
            .run_model_step(
                env,
                attack_turn(&turn_id, &format!("big-model-request {mib}")),
            )
            .await
            .expect("run")
            .expect("outcome");
        let TurnOutcome::Completed(done) = outcome else {
            panic!("turn {n}: expected a completed turn")
        };
        assert_eq!(
            done.new_messages[0].text.as_deref(),
            Some(format!("sent {mib} MiB: noted").as_str())
        );
    }
    assert_eq!(model.request_count(), turns);
    let sent = (turns as usize) * mib * MIB;
    let held = model.held_bytes();
    eprintln!("{turns} requests of {mib} MiB ({sent} bytes) sent; the provider holds {held} bytes");
    assert!(
        held < 64 << 10,
        "the provider holds {held} bytes after {sent} bytes of requests"
    );
    // What it keeps says how large each request was, and how it began.
    let kept = model.requests();
    assert_eq!(kept.len(), dexa::providers::scripted::KEPT_REQUESTS);
    for summary in &kept {
        assert_eq!(summary.bytes, mib * MIB);
        assert_eq!(summary.message_count, 1);
        assert_eq!(summary.messages[0].content_bytes, mib * MIB);
        let prefix = summary.messages[0].content.as_deref().unwrap_or_default();
        assert_eq!(
            prefix,
            "m".repeat(dexa::providers::scripted::KEPT_TEXT_BYTES)
        );
    }
}

/// `dexa.toml`: hostile-runner (128 MiB of memory, room for a 32 MiB
/// request) with the scripted model `replay`, answering "noted" forever.
fn render(dir: &std::path::Path) -> String {
    std::fs::write(dir.join("responses.json"), r#"[{"text": "noted"}]"#)
        .unwrap_or_else(|err| panic!("responses: {err}"));
    format!(
        r#"store = "sqlite:store.sqlite"
cache_dir = "{cache}"

[worker]
poll_interval = "20ms"

[components.hostile-runner]
path = "{runner}"
limits = {{ memory = "128MiB" }}

[models.replay]
provider = "scripted"
responses = "responses.json"
repeat = true

[agents.Big]
runner = "hostile-runner"
model = "replay"
model_step_timeout = "60s"
"#,
        cache = repo_root().join("target/test-component-cache").display(),
        runner = guest_wasm("hostile-runner").display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_does_not_keep_the_model_requests_a_runner_sends_the_scripted_model() {
    let mut stack = AgentTestStack::with_config(render);
    let worker = stack.start_worker();
    let pid = stack.worker(worker).pid();
    let sessions = stack.sessions("Big");
    let (turns, mib) = (6u64, 32u64);
    let attack = format!("big-model-request {mib}");
    sessions
        .start_session("big", &attack)
        .await
        .unwrap_or_else(|err| panic!("start: {err}"));
    let first = wait_for_turns(&sessions, "big", 1).await;
    let expected = format!("sent {mib} MiB: noted");
    assert_eq!(
        last_text(&first).as_deref(),
        Some(expected.as_str()),
        "{:?}\n{}",
        first.state.and_then(|s| s.last_turn_error),
        stack.worker_log(worker)
    );
    let mut peaks = vec![peak_rss_mib(pid)];
    for turn in 2..=turns {
        let end = next_turn(&sessions, "big", turn, &attack).await;
        assert_eq!(end.text, expected, "turn {turn}: {:?}", end.error);
        peaks.push(peak_rss_mib(pid));
    }
    eprintln!(
        "worker peak RSS (VmHWM) after each of {turns} turns of {mib} MiB model requests: {peaks:?} MiB"
    );
    // The first turn's peak holds one request in flight (in the guest and
    // on the host); later turns may add allocator slack, never a request
    // each. Keeping them would add (turns - 1) * mib = 160 MiB. An
    // allocator that returns freed memory late (mimalloc's default second)
    // holds the last turn's request while the next arrives: 32 MiB more.
    let growth = peaks[peaks.len() - 1] - peaks[0];
    assert!(
        growth < mib,
        "the worker's peak grew by {growth} MiB over {} more turns of {mib} MiB requests: {peaks:?}",
        turns - 1
    );
}
