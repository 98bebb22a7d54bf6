//! Untrusted components written in Python and JavaScript: the hostile
//! fixtures of `hostile.rs`, as `guests/python/hostile-*` and
//! `guests/js/hostile-tool`, on a real `dexa worker`. Each attack must fail
//! only its own Step with a readable recorded error (the interpreter's own
//! exception included), the session must follow the spec's failure route,
//! and the worker must go on serving.

use dexa::session::{step, AgentSessionClient, MessageRole};
use dexa_tests::hostile::{
    assert_a_trap_in_build_user_message_fails_only_that_message,
    assert_runner_attacks_fail_their_turns, assert_three_failed_attempts_then, first_turn, Peers,
    GRANTED_VAR, SECRET_FILE_TEXT, SECRET_VALUE, SECRET_VAR,
};
use dexa_tests::kit::AgentTestStack;
use dexa_tests::languages::{
    precompile_language_guests, JS_HOSTILE_TOOL, PYTHON_HOSTILE_RUNNER, PYTHON_HOSTILE_TOOL,
};
use dexa_tests::{guest_wasm, repo_root};
use serde_json::{json, Value};

fn render(dir: &std::path::Path, peers: &Peers) -> String {
    let data = dir.join("data");
    std::fs::create_dir_all(&data).expect("data dir");
    std::fs::write(data.join("visible.txt"), "granted text").expect("visible file");
    std::fs::write(dir.join("secret.txt"), SECRET_FILE_TEXT).expect("secret file");
    std::os::unix::fs::symlink("../secret.txt", data.join("link")).expect("symlink");
    format!(
        r#"store = "sqlite:store.sqlite"
cache_dir = "{cache}"

[worker]
slots = 16
lease = "3s"
poll_interval = "50ms"
reap_interval = "100ms"

[components.scripted-runner]
path = "{scripted_runner}"

[components.echo-tool]
path = "{echo_tool}"

[components.py-hostile-tool]
path = "{py_tool}"
dirs = [{{ host = "data", guest = "/data", access = "read_only" }}]
env = ["{GRANTED_VAR}"]
tcp_connect = ["127.0.0.1:{tcp_ok}"]

[components.js-hostile-tool]
path = "{js_tool}"

[components.py-hostile-runner]
path = "{py_runner}"

# Bounded attacks get time to spare on a busy machine; the spinning ones a
# short deadline.
[agents.PyAttacks]
runner = "scripted-runner"
tools = ["py-hostile-tool"]
tool_attempt_timeout = "120s"

[agents.JsAttacks]
runner = "scripted-runner"
tools = ["js-hostile-tool"]
tool_attempt_timeout = "120s"

[agents.PySpin]
runner = "scripted-runner"
tools = ["py-hostile-tool"]
tool_attempt_timeout = "2s"

[agents.JsSpin]
runner = "scripted-runner"
tools = ["js-hostile-tool"]
tool_attempt_timeout = "2s"

[agents.PyRunnerAttacks]
runner = "py-hostile-runner"
model_step_timeout = "120s"

[agents.PyRunnerSpin]
runner = "py-hostile-runner"
model_step_timeout = "2s"

[agents.Healthy]
runner = "scripted-runner"
tools = ["echo-tool"]
"#,
        cache = repo_root().join("target/test-component-cache").display(),
        scripted_runner = guest_wasm("scripted-runner").display(),
        echo_tool = guest_wasm("echo-tool").display(),
        py_tool = PYTHON_HOSTILE_TOOL.wasm().display(),
        js_tool = JS_HOSTILE_TOOL.wasm().display(),
        py_runner = PYTHON_HOSTILE_RUNNER.wasm().display(),
        tcp_ok = peers.tcp_granted.port,
    )
}

fn stack(peers: &Peers) -> AgentTestStack {
    precompile_language_guests();
    let mut stack = AgentTestStack::with_config(|dir| render(dir, peers));
    stack.start_worker_with_env(
        &[],
        &[(GRANTED_VAR, "granted-value"), (SECRET_VAR, SECRET_VALUE)],
    );
    stack
}

/// Runs `tool` with `args` as the only call of session `id`'s first turn
/// (the scripted runner takes a one-turn script from the message) and
/// returns the tool's outcome as the runner got it.
async fn attack(sessions: &AgentSessionClient, id: &str, tool: &str, args: Value) -> String {
    let script = json!({"steps": [
        {"tool_calls": [{"id": "c1", "name": tool, "arguments": args, "effect": "read"}]},
        {"text": "done"},
    ]});
    let end = first_turn(sessions, id, &script.to_string()).await;
    assert_eq!(end.error, None, "{tool}: the turn should complete");
    assert_eq!(end.text, "done", "{tool}");
    let snapshot = sessions
        .get_agent_snapshot(id)
        .await
        .unwrap_or_else(|err| panic!("snapshot {id}: {err}"));
    snapshot
        .messages
        .iter()
        .find(|m| m.role == MessageRole::Tool)
        .and_then(|m| m.text.clone())
        .unwrap_or_else(|| panic!("{tool}: no tool message in {:?}", snapshot.messages))
}

fn assert_failed(outcome: &str, tool: &str, expected: &str) {
    assert!(
        outcome.starts_with("Tool call failed: "),
        "{tool}: expected a failed call, got {outcome:?}"
    );
    assert!(
        outcome.contains(expected),
        "{tool}: the recorded error should mention {expected:?}: {outcome}"
    );
}

/// A call whose guest trapped (an uncaught exception, in these languages):
/// the model read one line, not `trap_text`, which the Step history of
/// session `t{index}` keeps.
async fn assert_crashed(
    stack: &AgentTestStack,
    index: usize,
    outcome: &str,
    tool: &str,
    trap_text: &str,
) {
    assert_failed(outcome, tool, dexa_tests::hostile::CRASHED_NOTE);
    assert!(
        !outcome.contains(trap_text),
        "{tool}: the trap's text reached the model: {outcome}"
    );
    let history = stack.read_step_history(&format!("t{index}")).await;
    assert!(
        history
            .iter()
            .any(|e| e.detail.as_deref().is_some_and(|d| d.contains(trap_text))),
        "{tool}: the Step history should keep {trap_text:?}: {history:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_python_and_javascript_tool_attack_fails_only_its_own_call() {
    let peers = Peers::start();
    let stack = stack(&peers);
    let py = stack.sessions("PyAttacks");
    let js = stack.sessions("JsAttacks");
    let tcp_refused = format!("127.0.0.1:{}", peers.tcp_refused.port);
    let tcp_granted = format!("127.0.0.1:{}", peers.tcp_granted.port);
    // The attacks that do not spin run at once, with a deadline they never
    // need; the spinning ones follow, on agents with a 2 s deadline.
    let py_attacks = [
        ("py_memory_bomb", json!({})),
        ("py_recurse", json!({})),
        ("py_read_file", json!({"path": "/data/../secret.txt"})),
        ("py_read_file", json!({"path": "/data/link"})),
        ("py_read_file", json!({"path": "/data/visible.txt"})),
        ("py_read_env", json!({"name": SECRET_VAR})),
        ("py_read_env", json!({"name": GRANTED_VAR})),
        ("py_tcp_connect", json!({"addr": tcp_refused})),
        ("py_tcp_connect", json!({"addr": tcp_granted})),
        ("py_big_output", json!({"megabytes": 2})),
        ("py_event_flood", json!({})),
        ("py_trap", json!({})),
    ];
    let js_attacks = [
        ("js_memory_bomb", json!({})),
        ("js_recurse", json!({})),
        ("js_big_output", json!({"megabytes": 2})),
        ("js_event_flood", json!({})),
        ("js_trap", json!({})),
    ];
    let runs = py_attacks
        .iter()
        .map(|(tool, args)| (&py, tool, args))
        .chain(js_attacks.iter().map(|(tool, args)| (&js, tool, args)))
        .enumerate()
        .map(|(index, (sessions, tool, args))| async move {
            attack(sessions, &format!("t{index}"), tool, args.clone()).await
        });
    let ends = futures_util::future::join_all(runs).await;

    let limit = "linear memory would grow to";
    assert_failed(&ends[0], "py_memory_bomb", limit);
    // CPython keeps its frames on the heap: deep recursion runs into the
    // memory limit before the wasm stack.
    assert_failed(&ends[1], "py_recurse", limit);
    // An uncaught exception is a trap: the model reads one line, and the
    // exception stays in the history.
    for (index, path) in [(2, "/data/../secret.txt"), (3, "/data/link")] {
        let end = &ends[index];
        assert_crashed(
            &stack,
            index,
            end,
            "py_read_file",
            &format!("PermissionError: [Errno 63] Operation not permitted: '{path}'"),
        )
        .await;
        assert!(!end.contains(SECRET_FILE_TEXT), "{path} leaked: {end}");
    }
    assert_eq!(ends[4], "granted text");
    assert_crashed(
        &stack,
        5,
        &ends[5],
        "py_read_env",
        &format!("KeyError: '{SECRET_VAR}'"),
    )
    .await;
    assert!(!ends[5].contains(SECRET_VALUE));
    assert_eq!(ends[6], "granted-value");
    assert_crashed(&stack, 7, &ends[7], "py_tcp_connect", "PermissionError").await;
    assert_eq!(ends[8], "connected", "a granted address is reachable");
    let output_limit = "over the output limit of 1048576 bytes";
    assert_failed(&ends[9], "py_big_output", output_limit);
    // Events over the budget are dropped and the call goes on.
    assert_eq!(ends[10], "flooded");
    assert_crashed(
        &stack,
        11,
        &ends[11],
        "py_trap",
        "RuntimeError: py-hostile-tool raises on purpose",
    )
    .await;
    assert_failed(&ends[12], "js_memory_bomb", limit);
    assert_crashed(
        &stack,
        13,
        &ends[13],
        "js_recurse",
        "InternalError: too much recursion",
    )
    .await;
    assert_failed(&ends[14], "js_big_output", output_limit);
    assert_eq!(ends[15], "flooded");
    assert_crashed(
        &stack,
        16,
        &ends[16],
        "js_trap",
        "Error: js-hostile-tool throws on purpose",
    )
    .await;
    assert_eq!(
        peers.tcp_refused.connections(),
        0,
        "no socket to an address not granted"
    );
    assert!(peers.tcp_granted.connections() >= 1);

    // A trap is a failed attempt: three of them, then RecordToolFailure,
    // each attempt's error (the Python traceback) in the history.
    let history = stack.read_step_history("t11").await;
    assert_three_failed_attempts_then(&history, step::CALL_TOOL, step::RECORD_TOOL_FAILURE);
    for entry in history.iter().filter(|e| e.step_type == step::CALL_TOOL) {
        let detail = entry.detail.as_deref().unwrap_or_default();
        assert!(
            detail.contains("Traceback (most recent call last)"),
            "{detail}"
        );
    }

    // The interpreters' endless loops stop at the deadline.
    let (py_spin, js_spin) = (stack.sessions("PySpin"), stack.sessions("JsSpin"));
    let spins = futures_util::future::join(
        attack(&py_spin, "spin-py", "py_spin", json!({})),
        attack(&js_spin, "spin-js", "js_spin", json!({})),
    )
    .await;
    assert_failed(&spins.0, "py_spin", "ran past its deadline of 2s");
    assert_failed(&spins.1, "js_spin", "ran past its deadline of 2s");

    // The worker that ran every attack still serves a healthy agent.
    let healthy = stack.sessions("Healthy");
    let script = json!({"steps": [{"text": "fine"}]});
    let end = first_turn(&healthy, "after", &script.to_string()).await;
    assert_eq!(end.text, "fine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_python_runner_attack_fails_its_turn_by_the_spec_route_and_the_session_goes_on() {
    let peers = Peers::start();
    let stack = stack(&peers);
    let sessions = stack.sessions("PyRunnerAttacks");
    let failing = [
        (
            "trap-model",
            "RuntimeError: py-hostile-runner run_model_step raises on purpose",
        ),
        ("err-model", "py-hostile-runner returns an error on purpose"),
        ("memory-bomb", "linear memory would grow to"),
        ("empty-run-state", "framework_run_state is empty"),
        (
            "dup-ids",
            "tool call id \"c1\" is not unique within the turn",
        ),
        ("slash-ids", "tool call id \"a/b\" contains '/'"),
        (
            "big-run-state",
            "framework run state is 4194304 bytes, over the limit of 1048576 bytes",
        ),
        (
            "history-flood",
            "history.read was called more than 1000 times in one call",
        ),
    ];
    assert_runner_attacks_fail_their_turns(&sessions, &failing).await;
    // The endless loop alone, so that it starves no other attack, on the
    // agent whose short deadline stops it.
    let spin = [("spin", "`run-model-step` ran past its deadline of 2s")];
    assert_runner_attacks_fail_their_turns(&stack.sessions("PyRunnerSpin"), &spin).await;

    // A raising run_model_step is retried three times, then RecordTurnFailure.
    let history = stack.read_step_history("trap-model").await;
    assert_three_failed_attempts_then(&history, step::RUN_MODEL, step::RECORD_TURN_FAILURE);

    // A trap in build-user-message gives that message up, with the reason
    // recorded, and the session goes on.
    assert_a_trap_in_build_user_message_fails_only_that_message(
        &stack,
        &sessions,
        "RuntimeError: py-hostile-runner build_user_message raises on purpose",
    )
    .await;

    // Other sessions of the same agent, on the same worker, are untouched.
    let end = first_turn(&sessions, "still-fine", "hello").await;
    assert_eq!(end.text, "ok: hello");
}
