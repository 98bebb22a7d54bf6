//! Untrusted components: `guests/hostile/` attacks its sandbox from a tool
//! and from a runner, on real `dexa worker` processes. Each attack must fail
//! only its own Step, with a readable recorded error, and the session must
//! then follow the spec's failure route. The latency of a healthy session
//! beside the attacks is in `hostile_latency.rs`, alone in its process.

use std::time::Duration;

use dexa::session::step;
use dexa_tests::hostile::*;
use dexa_tests::kit::{wait_for_turns, AgentTestStack};
use dexa_tests::session::last_text;
use dexa_tests::{guest_wasm, repo_root};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tool_attack_fails_only_its_own_call_with_a_readable_recorded_error() {
    let peers = Peers::start();
    let stack = stack(&peers, "");
    let sessions = stack.sessions("Attacks");
    let http_refused = format!("http://127.0.0.1:{}/steal", peers.http_refused.port);
    let http_granted = format!("http://127.0.0.1:{}/ok", peers.http_granted.port);
    let tcp_refused = format!("127.0.0.1:{}", peers.tcp_refused.port);
    let tcp_granted = format!("127.0.0.1:{}", peers.tcp_granted.port);
    let attacks = vec![
        ("spin", json!({})),
        ("memory_bomb", json!({})),
        ("recurse", json!({})),
        ("trap", json!({})),
        ("event_flood", json!({})),
        ("big_output", json!({"megabytes": 100})),
        ("read_file", json!({"path": "/data/../secret.txt"})),
        ("read_file", json!({"path": "/data/link"})),
        ("read_file", json!({"path": "/data/visible.txt"})),
        ("read_env", json!({"name": SECRET_VAR})),
        ("read_env", json!({"name": GRANTED_VAR})),
        ("http_get", json!({"url": http_refused})),
        ("http_get", json!({"url": http_granted})),
        ("tcp_connect", json!({"addr": tcp_refused})),
        ("tcp_connect", json!({"addr": tcp_granted})),
        ("handle_hoard", json!({})),
    ];
    // All at once, on one worker: each must fail (or pass) on its own.
    let runs = attacks.iter().enumerate().map(|(index, (tool, args))| {
        let sessions = sessions.clone();
        let message = format!("tool {tool} {args}");
        async move { first_turn(&sessions, &format!("t{index}"), &message).await }
    });
    let ends = futures_util::future::join_all(runs).await;

    assert_tool_failed(&ends[0], "spin", "ran past its deadline of 1s");
    assert_tool_failed(&ends[1], "memory_bomb", "linear memory would grow to");
    assert_tool_failed(&ends[2], "recurse", "call stack exhausted");
    assert_tool_failed(&ends[3], "trap", "hostile tool panics on purpose");
    // Events over the budget are dropped; the call goes on and succeeds.
    assert!(
        tool_report(&ends[4], "event_flood").contains("Succeeded output=Some(\"flooded\")"),
        "{:?}",
        ends[4]
    );
    assert_tool_failed(
        &ends[5],
        "big_output",
        "over the output limit of 1048576 bytes",
    );
    for (end, path) in [(&ends[6], "/data/../secret.txt"), (&ends[7], "/data/link")] {
        assert_tool_failed(end, "read_file", &format!("cannot read {path}"));
        assert!(
            !end.text.contains(SECRET_FILE_TEXT),
            "{path} leaked: {}",
            end.text
        );
    }
    assert!(
        tool_report(&ends[8], "read_file").contains("Succeeded output=Some(\"granted text\")"),
        "the granted file is readable: {:?}",
        ends[8]
    );
    assert_tool_failed(
        &ends[9],
        "read_env",
        &format!("{SECRET_VAR} is not set; visible variables: [\\\"{GRANTED_VAR}\\\"]"),
    );
    assert!(!ends[9].text.contains(SECRET_VALUE));
    assert!(
        tool_report(&ends[10], "read_env").contains("Succeeded output=Some(\"granted-value\")"),
        "{:?}",
        ends[10]
    );
    assert_tool_failed(&ends[11], "http_get", "HttpRequestDenied");
    assert!(
        tool_report(&ends[12], "http_get").contains("Succeeded output=Some(\"200 hello\")"),
        "{:?}",
        ends[12]
    );
    assert_tool_failed(&ends[13], "tcp_connect", "access-denied");
    assert!(
        tool_report(&ends[14], "tcp_connect").contains("Succeeded"),
        "{:?}",
        ends[14]
    );
    // Host-side handles are capped per call (4096 by default).
    assert_tool_failed(&ends[15], "handle_hoard", "resource table has no free keys");
    assert_eq!(
        peers.http_refused.connections(),
        0,
        "no byte to a host not granted"
    );
    assert_eq!(
        peers.tcp_refused.connections(),
        0,
        "no socket to an address not granted"
    );
    assert!(peers.http_granted.connections() >= 1);
    assert!(peers.tcp_granted.connections() >= 1);

    // A Step failure takes the spec's route: three attempts, then
    // RecordToolFailure, each attempt's error in the history.
    let history = stack.read_step_history("t0").await;
    assert_three_failed_attempts_then(&history, step::CALL_TOOL, step::RECORD_TOOL_FAILURE);
    for entry in history.iter().filter(|e| e.step_type == step::CALL_TOOL) {
        let detail = entry.detail.as_deref().unwrap_or_default();
        assert!(detail.contains("`call` ran past its deadline"), "{detail}");
    }

    // The worker that ran every attack is still serving.
    let healthy = stack.sessions("Healthy");
    let end = first_turn(&healthy, "after", "hello").await;
    assert_eq!(end.text, "fine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_runner_attack_fails_its_turn_by_the_spec_route_and_the_session_goes_on() {
    let peers = Peers::start();
    let stack = stack(&peers, "");
    let sessions = stack.sessions("Attacks");
    let failing = [
        ("spin", "`run-model-step` ran past its deadline of 1s"),
        ("memory-bomb", "linear memory would grow to"),
        ("recurse", "call stack exhausted"),
        ("trap-model", "hostile run-model-step traps on purpose"),
        ("big-output", "over the output limit of 1048576 bytes"),
        (
            "big-run-state",
            "framework run state is 4194304 bytes, over the limit of 1048576 bytes",
        ),
        ("empty-run-state", "framework_run_state is empty"),
        (
            "dup-ids",
            "tool call id \"c1\" is not unique within the turn",
        ),
        ("slash-ids", "tool call id \"a/b\" contains '/'"),
    ];
    assert_runner_attacks_fail_their_turns(&sessions, &failing).await;

    // 10 MB of deltas against a 64 KiB budget: the rest is dropped, the
    // turn completes, and the stream holds at most the budget.
    let end = first_turn(&sessions, "event-flood", "event-flood").await;
    assert_eq!(end.text, "flooded");
    let (events, _) = sessions
        .read_events("event-flood", 0, 10_000)
        .await
        .expect("events");
    let stored: usize = events
        .iter()
        .filter(|(_, e)| e.event_type == "text_delta")
        .map(|(_, e)| e.data["text"].as_str().map_or(0, str::len))
        .sum();
    assert!(
        stored > 0 && stored <= 64 << 10,
        "{stored} bytes of deltas stored"
    );

    // A trapping RunModel is retried three times, then RecordTurnFailure.
    let history = stack.read_step_history("trap-model").await;
    assert_three_failed_attempts_then(&history, step::RUN_MODEL, step::RECORD_TURN_FAILURE);

    // A trap in execute-deferred-tool-call fails that tool call only.
    let end = first_turn(&sessions, "trap-deferred", "trap-deferred").await;
    let report = tool_report(&end, "runner_trap");
    assert!(
        report.starts_with("runner_trap Failed") && report.contains("traps on purpose"),
        "{report}"
    );

    // The runner sees no environment, no files, and not the model's key.
    let end = first_turn(&sessions, "env", "env").await;
    assert!(end.text.starts_with("env: []; root: Err("), "{}", end.text);
    assert!(!end.text.contains(MODEL_KEY));

    // A trap in build-user-message gives that message up, with the reason
    // recorded, and the session goes on.
    assert_a_trap_in_build_user_message_fails_only_that_message(
        &stack,
        &sessions,
        "hostile build-user-message traps on purpose",
    )
    .await;

    // Other sessions of the same agent, on the same worker, are untouched.
    let end = first_turn(&sessions, "still-fine", "hello").await;
    assert_eq!(end.text, "ok: hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fuel_limit_stops_a_spinning_tool_before_its_deadline() {
    let peers = Peers::start();
    // 1 s of deadline would stop the spin too; fuel must stop it first.
    let stack = stack(&peers, ", fuel = 20_000_000");
    let sessions = stack.sessions("Attacks");
    let end = first_turn(&sessions, "fuel", "tool spin {}").await;
    assert_tool_failed(&end, "spin", "ran out of fuel (20000000 units)");
    // Ordinary calls fit in the same budget.
    let end = first_turn(
        &sessions,
        "fuel-ok",
        "tool read_env {\"name\":\"DEXA_HOSTILE_GRANTED\"}",
    )
    .await;
    assert!(
        tool_report(&end, "read_env").contains("Succeeded"),
        "{end:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_whose_list_tools_traps_is_refused_at_load_by_name() {
    let peers = Peers::start();
    let mut stack = AgentTestStack::with_config(|dir| {
        render(dir, &peers, "").replace(
            "[components.hostile-tool]\n",
            "[components.hostile-tool]\nconfig = { trap_in_list_tools = \"true\" }\n",
        )
    });
    let worker = stack.start_worker_with_env(&[], &WORKER_ENV);
    let status = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(status) = stack.worker(worker).exit_status() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the worker should refuse to start");
    assert!(!status.success());
    let log = stack.worker_log(worker);
    assert!(
        log.contains("component `hostile-tool`: `list-tools` failed at load")
            && log.contains("hostile list-tools traps on purpose"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrent_calls_queues_calls_of_one_component_beyond_the_limit() {
    // gate-tool with one instance at a time: the second of two parallel
    // gates is reached only after the first is released.
    let mut stack = AgentTestStack::with_config(|dir| {
        let script = json!({"turns": [{"steps": [
            {"tool_calls": [
                {"id": "a", "name": "gate", "arguments": {"name": "a"}, "effect": "read"},
                {"id": "b", "name": "gate", "arguments": {"name": "b"}, "effect": "read"},
            ]},
            {"text": "both done"},
        ]}]});
        format!(
            r#"store = "sqlite:store.sqlite"
cache_dir = "{cache}"
[worker]
slots = 8
poll_interval = "50ms"
[components.runner]
path = "{runner}"
config = {{ script = '{script}' }}
[components.gate-tool]
path = "{gate}"
dirs = [{{ host = "{gates}", guest = "/gates", access = "read_write" }}]
limits = {{ max_concurrent_calls = 1 }}
[agents.Gated]
runner = "runner"
tools = ["gate-tool"]
"#,
            cache = repo_root().join("target/test-component-cache").display(),
            runner = guest_wasm("scripted-runner").display(),
            gate = guest_wasm("gate-tool").display(),
            gates = dir.join("gates").display(),
        )
    });
    stack.start_worker();
    let sessions = stack.sessions("Gated");
    sessions.start_session("s1", "go").await.expect("start");
    let (a, b) = (stack.gate("a"), stack.gate("b"));
    let first = tokio::select! {
        () = a.wait_until_reached() => a.clone(),
        () = b.wait_until_reached() => b.clone(),
    };
    let second = if first.is_reached() && b.is_reached() && a.is_reached() {
        panic!("both gates were reached at once with max_concurrent_calls = 1");
    } else if a.is_reached() {
        b
    } else {
        a
    };
    // The other call is waiting for the one instance, not running.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!second.is_reached(), "the second call ran beside the first");
    first.release();
    second.wait_until_reached().await;
    second.release();
    let snapshot = wait_for_turns(&sessions, "s1", 1).await;
    assert_eq!(last_text(&snapshot).as_deref(), Some("both done"));
}
