//! Untrusted components: `guests/hostile/` attacks its sandbox from a tool
//! and from a runner, on real `dexa worker` processes. Each attack must fail
//! only its own Step, with a readable recorded error, and the session must
//! then follow the spec's failure route. The latency of a healthy session
//! beside the attacks is in `hostile_latency.rs`, alone in its process.

use std::time::Duration;

use dexa::session::step;
use dexa_tests::hostile::*;
use dexa_tests::kit::{wait_for_turns, AgentTestStack};
use dexa_tests::measure::peak_rss_mib;
use dexa_tests::session::last_text;
use dexa_tests::wat::wat_component;
use dexa_tests::{guest_wasm, repo_root};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tool_attack_fails_only_its_own_call_with_a_readable_recorded_error() {
    let peers = Peers::start();
    let stack = stack(&peers, "");
    let sessions = stack.sessions("Attacks");
    let spinner = stack.sessions("Spinner");
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
        ("stderr_exit", json!({})),
    ];
    // All at once, on one worker: each must fail (or pass) on its own. Only
    // the spin is stopped by its (1 s) deadline; every other attack has 60 s
    // and must meet its own limit long before.
    let runs = attacks.iter().enumerate().map(|(index, (tool, args))| {
        let sessions = if *tool == "spin" { &spinner } else { &sessions }.clone();
        let message = format!("tool {tool} {args}");
        async move { first_turn(&sessions, &format!("t{index}"), &message).await }
    });
    let ends = futures_util::future::join_all(runs).await;

    assert_tool_failed(&ends[0], "spin", "ran past its deadline of 1s");
    assert_tool_failed(&ends[1], "memory_bomb", "linear memory would grow to");
    // A trap's text (a panic, a stack overflow) stays out of the model's
    // context: the history keeps it.
    let history = stack.read_step_history("t2").await;
    assert_tool_crashed(&ends[2], "recurse", &history, "call stack exhausted");
    let history = stack.read_step_history("t3").await;
    assert_tool_crashed(&ends[3], "trap", &history, "hostile tool panics on purpose");
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
    // Not a trap (an exit), so the host's reason is shown, but never what
    // the guest wrote to stderr.
    assert_tool_failed(&ends[16], "stderr_exit", "exit status");
    assert!(
        !ends[16].text.contains("hostile stderr for the model"),
        "{:?}",
        ends[16]
    );
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
    // The sandbox's deadline stops the spin; on a machine so loaded that
    // the guest thread is not even scheduled in time, the Step's own attempt
    // timeout (the deadline plus a grace) does: either way, the deadline.
    for entry in history.iter().filter(|e| e.step_type == step::CALL_TOOL) {
        let detail = entry.detail.as_deref().unwrap_or_default();
        assert!(
            detail.contains("`call` ran past its deadline") || detail.contains("attempt timed out"),
            "{detail}"
        );
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
    let spin = [("spin", "`run-model-step` ran past its deadline of 1s")];
    assert_runner_attacks_fail_their_turns(&stack.sessions("Spinner"), &spin).await;
    let failing = [
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
        (
            "history-flood",
            "history.read was called more than 1000 times in one call",
        ),
        (
            "compact-past-end",
            "compacts through message 18446744073709551615, but the history has 1 message(s)",
        ),
    ];
    assert_runner_attacks_fail_their_turns(&sessions, &failing).await;

    // A second compaction in one turn fails the turn; the session goes on.
    let end = first_turn(&sessions, "compact-loop", "hello").await;
    assert_eq!(end.text, "ok: hello");
    let end = next_turn(&sessions, "compact-loop", 2, "compact-loop").await;
    let error = end.error.unwrap_or_default();
    assert!(error.contains("a turn may compact once"), "{error}");
    let end = next_turn(&sessions, "compact-loop", 3, "hello").await;
    assert_eq!(end.text, "ok: hello");
    assert_eq!(end.error, None);

    // Ranges past both ends, inverted, with limits 0 and u32::MAX: clamped,
    // never an error.
    let end = first_turn(&sessions, "history-range", "history-range").await;
    assert_eq!(
        end.text,
        "history-range: length 1, oldest-first 1 (first Some(1)), inverted 0, past the end 0"
    );

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
    let history = stack.read_step_history("trap-deferred").await;
    assert_tool_crashed(&end, "runner_trap", &history, "traps on purpose");

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
    let sessions = stack.sessions("Spinner");
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
    let log = refused_start_log(&mut stack, worker).await;
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

/// What a worker may hold at its peak while the containment attacks run:
/// its own baseline (the engine, five loaded components, the store) is about
/// 100 MiB; one 128 MiB call limit and the host's parse of one capped event
/// come on top. Before issue 15 the same attacks took it past 900 MiB.
const CONTAINED_PEAK_MIB: u64 = 400;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_and_table_limits_bound_the_sum_over_every_instance_of_a_call() {
    let mut stack = AgentTestStack::with_config(|dir| render_containment(dir, true));
    let worker = stack.start_worker();
    let sessions = stack.sessions("Wat");
    // Eight linear memories of 120 MiB each against a 128 MiB limit.
    let end = first_turn(&sessions, "memories", "tool memories {}").await;
    assert_tool_failed(
        &end,
        "memories",
        "linear memory would grow to 251789312 bytes across the instance's memories, \
         over the limit of 134217728 bytes",
    );
    // 24 tables of 20,000 elements against a 100,000-element limit.
    let end = first_turn(&sessions, "tables", "tool tables {}").await;
    assert_tool_failed(
        &end,
        "tables",
        "tables would grow to 120000 elements across the instance's tables, over the limit of 100000",
    );
    let peak = peak_rss_mib(stack.worker(worker).pid());
    println!("worker peak RSS after the memory and table attacks: {peak} MiB");
    assert!(
        peak > 0 && peak < CONTAINED_PEAK_MIB,
        "the worker peaked at {peak} MiB"
    );
    // The worker goes on serving.
    let end = first_turn(
        &stack.sessions("Events"),
        "after",
        "tool event_deep {\"depth\":2}",
    )
    .await;
    assert!(
        tool_report(&end, "event_deep").contains("Succeeded"),
        "{end:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_component_with_more_core_instances_than_the_limit_is_refused_at_load() {
    let mut stack = AgentTestStack::with_config(|dir| {
        render_containment(dir, true).replace(
            &format!("path = \"{}\"", wat_component("table-bomb").display()),
            &format!("path = \"{}\"", wat_component("instance-bomb").display()),
        )
    });
    let worker = stack.start_worker();
    let log = refused_start_log(&mut stack, worker).await;
    assert!(
        log.contains("table-bomb")
            && log.contains(
                "contains 101 core module instances, which exceeds the configured maximum of 64"
            ),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_payloads_are_checked_before_they_are_parsed_and_stay_readable_once_stored() {
    let mut stack = AgentTestStack::with_config(|dir| render_containment(dir, true));
    let worker = stack.start_worker();
    let sessions = stack.sessions("Events");
    // Not an object, as the interface says a payload is: the call fails,
    // and nothing is parsed (the event budget of 64 MiB would allow it).
    let end = first_turn(&sessions, "array", "tool event_array {\"megabytes\":40}").await;
    assert_tool_failed(
        &end,
        "event_array",
        "write-event \\\"big\\\": the payload is not a JSON object",
    );
    // An object over the size one event may have is dropped unparsed.
    let end = first_turn(&sessions, "object", "tool event_object {\"megabytes\":40}").await;
    assert!(
        tool_report(&end, "event_object").contains("Succeeded output=Some(\"written\")"),
        "{end:?}"
    );
    let (events, _) = sessions
        .read_events("object", 0, 1000)
        .await
        .expect("events");
    assert!(
        events.iter().all(|(_, e)| e.event_type != "big"),
        "the big event was dropped"
    );
    // As deep as accepted: stored, and read back by the stream's readers.
    let end = first_turn(&sessions, "deep64", "tool event_deep {\"depth\":64}").await;
    assert!(
        tool_report(&end, "event_deep").contains("wrote 64 levels"),
        "{end:?}"
    );
    let (events, _) = sessions
        .read_events("deep64", 0, 1000)
        .await
        .expect("a readable stream");
    let deep = events
        .iter()
        .find(|(_, e)| e.event_type == "deep")
        .expect("the deep event");
    let mut level = &deep.1.data;
    let mut depth = 1;
    while let Some(inner) = level.get("a") {
        level = inner;
        depth += 1;
    }
    assert_eq!(depth, 64);
    // One level deeper, or 127 levels (which once broke the session's live
    // stream for good): the call fails, and nothing is stored.
    for depth in [65, 127] {
        let id = format!("deep{depth}");
        let end = first_turn(
            &sessions,
            &id,
            &format!("tool event_deep {{\"depth\":{depth}}}"),
        )
        .await;
        assert_tool_failed(
            &end,
            "event_deep",
            "the payload nests deeper than 64 levels",
        );
        let (events, _) = sessions
            .read_events(&id, 0, 1000)
            .await
            .expect("a readable stream");
        assert!(events.iter().all(|(_, e)| e.event_type != "deep"));
    }
    let peak = peak_rss_mib(stack.worker(worker).pid());
    println!("worker peak RSS after the event attacks: {peak} MiB");
    assert!(
        peak > 0 && peak < CONTAINED_PEAK_MIB,
        "the worker peaked at {peak} MiB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_guest_prints_reaches_the_session_as_guest_log_events_and_the_log_with_its_step() {
    let mut stack = AgentTestStack::with_config(|dir| render_containment(dir, true));
    // Guest output is logged at info, under its own target.
    let worker = stack.start_worker_with_env(&[], &[("RUST_LOG", "warn,dexa::guest=info")]);
    let sessions = stack.sessions("Events");
    let end = first_turn(&sessions, "printer", "tool print {\"megabytes\":1}").await;
    assert!(
        tool_report(&end, "print").contains("Succeeded output=Some(\"printed\")"),
        "{end:?}"
    );
    let (events, _) = sessions
        .read_events("printer", 0, 1000)
        .await
        .expect("events");
    let logs: Vec<_> = events
        .iter()
        .filter(|(_, e)| e.event_type == "guest_log")
        .map(|(_, e)| e)
        .collect();
    let streams: Vec<&str> = logs
        .iter()
        .filter_map(|e| e.data["stream"].as_str())
        .collect();
    assert_eq!(streams, ["stderr", "stdout"], "{logs:?}");
    let step = &logs[0].step_execution_id;
    for event in &logs {
        assert_eq!(event.turn_id, "turn-1");
        assert_eq!(&event.step_execution_id, step, "the tool's Step");
        assert_eq!(event.data["component"], "hostile-tool");
        assert!(
            event.data["dropped_bytes"]
                .as_u64()
                .is_some_and(|n| n > 1_000_000),
            "a MiB printed, 16 KiB kept: {}",
            event.data["dropped_bytes"]
        );
        assert!(event.data["text"]
            .as_str()
            .is_some_and(|t| t.len() <= 17 << 10));
    }
    assert!(logs[1].data["text"]
        .as_str()
        .is_some_and(|t| t.starts_with("stdout: first line")));
    // The worker's log has both, tagged with the Step, each on one line: a
    // line the guest printed cannot pass for a line of the log.
    let log = stack.worker_log(worker);
    let lines: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("guest output"))
        .collect();
    assert_eq!(lines.len(), 2, "{log:.2000}");
    for line in &lines {
        assert!(
            line.contains("dexa::guest")
                && line.contains("flow_id=printer")
                && line.contains(&format!("step_execution_id={step}"))
                && line.contains("component=hostile-tool"),
            "{line:.300}"
        );
    }
    assert!(
        log.lines()
            .all(|line| !line.starts_with("stderr: first line")),
        "a guest's line break was written raw"
    );
    // A call that traps: its stderr is in the error the worker logs, and in
    // the guest_log line, escaped in both.
    let end = first_turn(&sessions, "forger", "tool trap {}").await;
    assert!(end.error.is_none(), "{end:?}");
    let log = stack.worker_log(worker);
    assert!(
        log.contains("FORGED-LOG-LINE"),
        "the trap's stderr is logged: {log:.2000}"
    );
    assert!(
        log.lines().all(|line| !line.starts_with("FORGED-LOG-LINE")),
        "a guest's line break started a log line: {log:.4000}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_grants_are_refused_unless_both_are_marked_shared() {
    let mut stack = AgentTestStack::with_config(|dir| render_containment(dir, false));
    let worker = stack.start_worker();
    let log = refused_start_log(&mut stack, worker).await;
    assert!(
        log.contains("\"reader-tool\" and \"writer-tool\" are granted overlapping directories")
            && log.contains("shared = true"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_component_cannot_redirect_a_grant_of_another_component() {
    let mut stack = AgentTestStack::with_config(|dir| render_containment(dir, true));
    stack.start_worker();
    let (writer, reader) = (stack.sessions("Writer"), stack.sessions("Reader"));
    let end = first_turn(
        &reader,
        "before",
        "tool read_file {\"path\":\"/sub/note.txt\"}",
    )
    .await;
    assert!(
        tool_report(&end, "read_file").contains("shared note"),
        "{end:?}"
    );
    // The writer may change its own directory: it turns `sub`, the reader's
    // grant, into a symlink to the directory beside it that holds a secret.
    let end = first_turn(
        &writer,
        "redirect",
        "tool redirect_grant {\"path\":\"/shared/sub\",\"target\":\"../outside\"}",
    )
    .await;
    assert!(
        tool_report(&end, "redirect_grant").contains("Succeeded"),
        "{end:?}"
    );
    // The reader's grant is not followed there: its call fails.
    let end = first_turn(
        &reader,
        "after",
        "tool read_file {\"path\":\"/sub/secret.txt\"}",
    )
    .await;
    assert_tool_failed(&end, "read_file", "is no longer a directory");
    assert!(
        !end.text.contains(SECRET_FILE_TEXT),
        "the secret leaked: {}",
        end.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_may_not_hold_dexas_own_state() {
    let mut stack = AgentTestStack::with_config(|dir| {
        render_containment(dir, true).replace(
            "host = \"shared/sub\", guest = \"/sub\"",
            "host = \".\", guest = \"/sub\"",
        )
    });
    let worker = stack.start_worker();
    let log = refused_start_log(&mut stack, worker).await;
    assert!(
        log.contains("component \"reader-tool\" may not be granted")
            && log.contains("holds dexa's own state"),
        "{log}"
    );
}

#[test]
fn component_call_grants_read_only_by_default_and_never_dexas_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join(".dexa")).expect(".dexa");
    std::fs::write(dir.path().join(".dexa/api-token"), "token-never-seen").expect("token");
    std::fs::create_dir_all(dir.path().join("work")).expect("work");
    let call = |tool: &str, args: &str, grant: &str| {
        let output = std::process::Command::new(dexa_tests::kit::dexa_binary())
            .current_dir(dir.path())
            .args(["component", "call"])
            .arg(guest_wasm("files-tool"))
            .args([tool, "--args", args, "--dir", grant, "--cache-dir"])
            .arg(repo_root().join("target/test-component-cache"))
            .output()
            .expect("run dexa");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), text)
    };
    let write = r#"{"path":"f.txt","content":"x"}"#;
    let (ok, text) = call("write_file", write, "work:/workspace");
    assert!(!ok && text.contains("cannot write f.txt"), "{text}");
    assert!(!dir.path().join("work/f.txt").exists());
    let (ok, text) = call("write_file", write, "work:/workspace:rw");
    assert!(ok && text.contains("wrote 1 bytes"), "{text}");
    // `.` holds `.dexa` (the store, the API token, compiled code).
    let (ok, text) = call("read_file", r#"{"path":".dexa/api-token"}"#, ".:/workspace");
    assert!(!ok && text.contains("holds dexa's own state"), "{text}");
    assert!(!text.contains("token-never-seen"), "{text}");
}

/// The measurement behind issue 15's numbers, not a check: the worker's
/// peak RSS after each containment attack. Run it with
/// `cargo build -p dexa && cargo test -p dexa-tests --test hostile -- --ignored --nocapture containment_peak_rss`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; prints numbers"]
async fn containment_peak_rss_under_each_attack() {
    let mut stack = AgentTestStack::with_config(|dir| render_containment(dir, true));
    let worker = stack.start_worker();
    let pid = stack.worker(worker).pid();
    let (wat, events) = (stack.sessions("Wat"), stack.sessions("Events"));
    let healthy = first_turn(&events, "warm", "tool event_deep {\"depth\":2}").await;
    println!("baseline: {} MiB ({healthy:?})", peak_rss_mib(pid));
    for (sessions, id, message) in [
        (&events, "array", "tool event_array {\"megabytes\":40}"),
        (&events, "object", "tool event_object {\"megabytes\":40}"),
        (&events, "deep", "tool event_deep {\"depth\":127}"),
        (&wat, "tables", "tool tables {}"),
        (&wat, "memories", "tool memories {}"),
    ] {
        let end = first_turn(sessions, id, message).await;
        let outcome: String = end.text.chars().take(120).collect();
        println!(
            "after {message}: peak {} MiB ({outcome})",
            peak_rss_mib(pid)
        );
    }
    match events.read_events("deep", 0, 1000).await {
        Ok((read, _)) => println!("the deep session's stream reads back {} events", read.len()),
        Err(err) => println!("the deep session's stream cannot be read: {err}"),
    }
}
