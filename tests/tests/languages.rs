//! Guests in other languages, through real sessions on real `dexa worker`
//! processes: the Python tool (`guests/python/tool`, componentize-py), the
//! JavaScript tool (`guests/js/tool`, componentize-js), the C tool
//! (`guests/c/tool`, wit-bindgen c) and the Python runner
//! (`guests/python/runner`), with the scenarios the Rust guests are tested
//! on:
//! - a tool's result reaches the session;
//! - `tool-error.execution` records `failed` without a retry;
//! - an unexpected exception becomes `tool-error.internal`, retried as the
//!   effect allows, then `failed` with the exception in the record;
//! - the idempotency key is the one the host passed;
//! - the toolchains' extra exports (componentize-py's `init`) are accepted.

use dexa::flow::history;
use dexa::plugin::World;
use dexa::session::{event_type, step, AgentSnapshot, MessageRole};
use dexa_tests::chat_server::{text_transcript, tool_calls_transcript, ReplayChatServer, Reply};
use dexa_tests::kit::{
    example_copy, inspect_component, run_demo, wait_for_turns, AgentTestStack, KitAgent,
};
use dexa_tests::languages::{
    precompile_language_guests, LanguageGuest, C_TOOL, JS_TOOL, LANGUAGE_GUESTS, PYTHON_RUNNER,
    PYTHON_TOOL,
};
use dexa_tests::repo_root;
use dexa_tests::session::{all_events, last_text, texts_of};
use serde_json::{json, Value};

/// The outcome of tool call `id` as the runner got it (through
/// `describe-tool-call-outcome`): its stored tool message. A finished turn's
/// records leave the snapshot; its messages stay.
fn outcome(snapshot: &AgentSnapshot, id: &str) -> String {
    snapshot
        .messages
        .iter()
        .filter(|m| m.role == MessageRole::Tool)
        .find(|m| {
            serde_json::from_str::<Value>(&m.framework_item)
                .is_ok_and(|item| item["tool_call_id"] == id)
        })
        .and_then(|m| m.text.clone())
        .unwrap_or_else(|| panic!("no tool message for {id} in {:?}", snapshot.messages))
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|err| panic!("{text:?} is not JSON: {err}"))
}

/// The scripted runner calls each of the guest's tools once; the tool
/// messages, the Step history and the events must show each scenario.
async fn tool_scenario(guest: LanguageGuest, unexpected: &str) {
    precompile_language_guests();
    let t = |name: &str| guest.tool(name);
    let script = json!({"turns": [{"steps": [
        {"tool_calls": [
            {"id": "c1", "name": t("echo"), "arguments": {"x": 1}, "effect": "read"},
            {"id": "c2", "name": t("describe_call"), "arguments": {"y": "é"}, "effect": "read"},
            {"id": "c3", "name": t("word_count"), "arguments": {"text": "the quick  brown fox"}, "effect": "read"},
            {"id": "c4", "name": t("fail"), "arguments": {"z": 3}, "effect": "read"},
            {"id": "c5", "name": t("raise"), "arguments": {}, "effect": "read"},
        ]},
        {"text": "done"},
    ]}]});
    let mut stack = AgentTestStack::new(vec![KitAgent::scripted("Lang", script).tool(guest.guest)]);
    stack.start_worker();
    let sessions = stack.sessions("Lang");
    sessions.start_session("s-é", "go").await.unwrap();
    let snapshot = wait_for_turns(&sessions, "s-é", 1).await;
    assert_eq!(
        last_text(&snapshot).as_deref(),
        Some("done"),
        "{snapshot:?}"
    );

    assert_eq!(outcome(&snapshot, "c1"), r#"{"x":1}"#);

    let described = parse(&outcome(&snapshot, "c2"));
    assert_eq!(described["language"], guest.language);
    assert_eq!(described["idempotency_key"], "s-é/turn-1/c2");
    assert_eq!(described["flow_id"], "s-é");
    assert_eq!(described["turn_id"], "turn-1");
    assert_eq!(described["tool_call_id"], "c2");
    assert_eq!(described["attempt"], 1);
    assert_eq!(described["arguments"], r#"{"y":"é"}"#);

    let counted = parse(&outcome(&snapshot, "c3"));
    assert_eq!(counted, json!({"words": 4}), "no greeting is configured");

    assert_eq!(
        outcome(&snapshot, "c4"),
        format!(
            r#"Tool call failed: {}-tool refused: {{"z":3}}"#,
            guest.language
        )
    );

    let raised = outcome(&snapshot, "c5");
    assert!(
        raised.starts_with("Tool call failed: the tool call did not complete"),
        "{raised}"
    );
    assert!(raised.contains(unexpected), "{raised}");

    // Only the unexpected exception was retried: 3 attempts, then
    // RecordToolFailure. The execution error completed on attempt 1.
    let history = stack.read_step_history("s-é").await;
    let call_tool = |event: &str| {
        history
            .iter()
            .filter(|e| e.step_type == step::CALL_TOOL && e.event_type == event)
            .collect::<Vec<_>>()
    };
    let completed = call_tool(history::EXECUTE_COMPLETED);
    assert_eq!(completed.len(), 4, "{history:?}");
    assert!(
        completed.iter().all(|e| e.final_attempt == 1),
        "{history:?}"
    );
    assert_eq!(call_tool(history::ATTEMPT_FAILED).len(), 2, "{history:?}");
    let last_failure = call_tool(history::EXECUTE_FAILED);
    assert_eq!(last_failure.len(), 1, "{history:?}");
    assert_eq!(last_failure[0].final_attempt, 3);
    assert!(
        history
            .iter()
            .any(|e| e.step_type == step::RECORD_TOOL_FAILURE
                && e.event_type == history::EXECUTE_COMPLETED),
        "{history:?}"
    );

    // The tool's own event, tagged by the host with its Step.
    let event_type = format!("{}.counted", t("word_count"));
    let events = all_events(&sessions, "s-é").await;
    let written: Vec<_> = events
        .iter()
        .filter(|e| e.event_type == event_type)
        .collect();
    assert_eq!(written.len(), 1, "{events:?}");
    assert_eq!(written[0].data, json!({"words": 4}));
    assert_eq!(written[0].turn_id, "turn-1");
    assert_eq!(written[0].attempt, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_tool_returns_results_fails_as_the_spec_says_and_sees_the_idempotency_key() {
    tool_scenario(PYTHON_TOOL, "ValueError: python-tool raised on purpose").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_javascript_tool_returns_results_fails_as_the_spec_says_and_sees_the_idempotency_key() {
    tool_scenario(JS_TOOL, "TypeError: javascript-tool threw on purpose").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_c_tool_returns_results_fails_as_the_spec_says_and_sees_the_idempotency_key() {
    // C has no exceptions: `c_raise` returns tool-error.internal itself.
    tool_scenario(C_TOOL, "c-tool failed internally on purpose").await;
}

const MODEL_KEY_VAR: &str = "DEXA_TEST_LANGUAGES_KEY";

fn runner_config(base_url: &str) -> String {
    format!(
        r#"store = "sqlite:store.sqlite"
cache_dir = "{cache}"

[worker]
slots = 8
lease = "3s"
poll_interval = "50ms"
reap_interval = "100ms"

[components.py-runner]
path = "{runner}"
config = {{ system_prompt = "You count words." }}

[components.py-tool]
path = "{py_tool}"
config = {{ greeting = "hello from dexa.toml" }}

[components.js-tool]
path = "{js_tool}"

[models.gpt]
provider = "openai"
base_url = "{base_url}"
model = "gpt-4o-mini"
api_key_env = "{MODEL_KEY_VAR}"

[agents.Polyglot]
runner = "py-runner"
tools = ["py-tool", "js-tool"]
model = "gpt"
"#,
        cache = repo_root().join("target/test-component-cache").display(),
        runner = PYTHON_RUNNER.wasm().display(),
        py_tool = PYTHON_TOOL.wasm().display(),
        js_tool = JS_TOOL.wasm().display(),
    )
}

/// The Python runner drives a real model protocol (the loopback OpenAI
/// server) over three turns: tool calls to the Python and JavaScript tools,
/// a turn whose model calls fail (the runner's `Err` retried, then the
/// turn-failure note, built by the runner's `build_user_message`), and a turn
/// that replays all of it to the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_runner_runs_the_agent_loop_with_python_and_javascript_tools() {
    precompile_language_guests();
    let server = ReplayChatServer::start(vec![
        Reply::Stream {
            transcript: tool_calls_transcript(
                &[
                    (
                        "call_a",
                        "py_word_count",
                        json!({"text": "the quick brown fox"}),
                    ),
                    ("call_b", "js_describe_call", json!({"q": 1})),
                    ("call_c", "js_fail", json!({})),
                ],
                (40, 12),
            ),
            piece: 7,
        },
        Reply::Stream {
            transcript: text_transcript("Four words.", (60, 3)),
            piece: 5,
        },
        Reply::Stream {
            transcript: tool_calls_transcript(&[("call_d", "py_echo", json!({"n": 2}))], (70, 5)),
            piece: 11,
        },
        Reply::Error {
            status: 400,
            message: "context too long".to_string(),
        },
        Reply::Error {
            status: 400,
            message: "context too long".to_string(),
        },
        Reply::Error {
            status: 400,
            message: "context too long".to_string(),
        },
        Reply::Stream {
            transcript: text_transcript("Back again.", (90, 3)),
            piece: 3,
        },
    ])
    .await;
    let base_url = server.base_url.clone();
    let mut stack = AgentTestStack::with_config(|_| runner_config(&base_url));
    stack.start_worker_with_env(&[], &[(MODEL_KEY_VAR, "sk-languages")]);
    let sessions = stack.sessions("Polyglot");

    // Turn 1: three tool calls, then the answer.
    sessions
        .start_session("p1", "Count the words of: the quick brown fox")
        .await
        .unwrap();
    let snapshot = wait_for_turns(&sessions, "p1", 1).await;
    assert_eq!(last_text(&snapshot).as_deref(), Some("Four words."));
    assert_eq!(
        parse(&outcome(&snapshot, "call_a")),
        json!({"words": 4, "greeting": "hello from dexa.toml"})
    );
    let described = parse(&outcome(&snapshot, "call_b"));
    assert_eq!(described["language"], "javascript");
    assert_eq!(described["idempotency_key"], "p1/turn-1/call_b");
    assert_eq!(
        outcome(&snapshot, "call_c"),
        "Tool call failed: javascript-tool refused: {}"
    );
    // The runner passed each tool's declared effect (read) as the
    // framework's; the agent's default (unclassified) would ask for approval.
    let deferred: Vec<Value> = all_events(&sessions, "p1")
        .await
        .into_iter()
        .filter(|e| e.event_type == event_type::TOOL_CALL_DEFERRED)
        .map(|e| e.data)
        .collect();
    assert_eq!(deferred.len(), 3, "{deferred:?}");
    for event in &deferred {
        assert_eq!(
            (&event["effect"], &event["requires_approval"]),
            (&json!("read"), &json!(false)),
            "{event}"
        );
    }
    // Stored: the user's message, the assistant's tool calls, three tool
    // results and the answer, each the runner's own JSON item.
    let roles: Vec<MessageRole> = snapshot.messages.iter().map(|m| m.role).collect();
    use MessageRole::{Assistant, Tool, User};
    assert_eq!(roles, [User, Assistant, Tool, Tool, Tool, Assistant]);
    let asked: Value = serde_json::from_str(&snapshot.messages[1].framework_item).unwrap();
    assert_eq!(
        asked["tool_calls"].as_array().map(Vec::len),
        Some(3),
        "{asked}"
    );
    assert_eq!(
        (snapshot.usage.input_tokens, snapshot.usage.output_tokens),
        (100, 15)
    );

    let sent = server.requests();
    assert_eq!(sent.len(), 2);
    assert_eq!(
        sent[0].authorization.as_deref(),
        Some("Bearer sk-languages")
    );
    let first = &sent[0].body;
    assert_eq!(
        first["messages"][0],
        json!({"role": "system", "content": "You count words."})
    );
    assert_eq!(
        first["messages"][1]["content"],
        "Count the words of: the quick brown fox"
    );
    let offered: Vec<&str> = first["tools"]
        .as_array()
        .map(|tools| {
            tools
                .iter()
                .filter_map(|t| t["function"]["name"].as_str())
                .collect()
        })
        .unwrap_or_default();
    for name in ["py_word_count", "py_echo", "js_describe_call", "js_fail"] {
        assert!(offered.contains(&name), "{name} not offered: {offered:?}");
    }
    // The second model call sees each tool's outcome against its call id.
    let second = sent[1].body["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let tool_message = |id: &str| {
        second
            .iter()
            .find(|m| m["role"] == "tool" && m["tool_call_id"] == id)
            .and_then(|m| m["content"].as_str())
            .unwrap_or_else(|| panic!("no tool message for {id} in {second:?}"))
            .to_string()
    };
    assert!(tool_message("call_a").contains("\"words\": 4"));
    assert!(tool_message("call_b").contains("p1/turn-1/call_b"));
    assert_eq!(
        tool_message("call_c"),
        "Tool call failed: javascript-tool refused: {}"
    );

    // Turn 2: a tool runs, then every model call fails: the runner's error
    // is retried 3 times, then the turn fails with the runner's message.
    assert!(sessions.send_user_message("p1", "Echo two.").await.unwrap());
    let snapshot = wait_for_turns(&sessions, "p1", 2).await;
    let error = snapshot
        .state
        .as_ref()
        .and_then(|s| s.last_turn_error.clone())
        .unwrap_or_else(|| panic!("turn 2 should fail: {snapshot:?}"));
    assert!(
        error.contains("the model call failed: rejected") && error.contains("context too long"),
        "{error}"
    );
    let history = stack.read_step_history("p1").await;
    let model_attempts = history
        .iter()
        .filter(|e| e.step_type == step::RUN_MODEL && e.event_type != history::EXECUTE_COMPLETED)
        .count();
    assert_eq!(model_attempts, 3, "{history:?}");
    // The host wrote the turn-failure note through the runner's
    // build_user_message.
    let note = snapshot
        .messages
        .last()
        .unwrap_or_else(|| panic!("no messages"));
    assert_eq!(note.role, User);
    let note_text = note.text.clone().unwrap_or_default();
    assert!(note_text.contains("py_echo"), "{note_text}");
    let note_item: Value = serde_json::from_str(&note.framework_item).unwrap();
    assert_eq!(note_item["role"], "user");
    assert_eq!(note_item["content"].as_str(), Some(note_text.as_str()));

    // Turn 3 works, and replays the conversation, the note included.
    assert!(sessions
        .send_user_message("p1", "Still there?")
        .await
        .unwrap());
    let snapshot = wait_for_turns(&sessions, "p1", 3).await;
    assert_eq!(last_text(&snapshot).as_deref(), Some("Back again."));
    assert!(snapshot
        .state
        .as_ref()
        .and_then(|s| s.last_turn_error.clone())
        .is_none());
    let sent = server.requests();
    assert_eq!(sent.len(), 7);
    let replayed = sent[6].body["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let contents: Vec<&str> = replayed
        .iter()
        .filter_map(|m| m["content"].as_str())
        .collect();
    assert!(contents.contains(&"Four words."), "{contents:?}");
    assert!(contents.contains(&note_text.as_str()), "{contents:?}");
    assert_eq!(contents.last(), Some(&"Still there?"));
    assert_eq!(
        texts_of(&snapshot, User).last().map(String::as_str),
        Some("Still there?")
    );
}

/// componentize-py adds an `exports` interface (with `init`) to every
/// component; componentize-js and wit-bindgen c add nothing. The host loads them all, names
/// the extra exports, and never calls them.
#[test]
fn the_host_loads_components_whose_toolchain_adds_exports_of_its_own() {
    let loaded = precompile_language_guests();
    for (guest, info) in LANGUAGE_GUESTS.iter().zip(loaded) {
        assert_eq!(info.world, guest.world, "{}", guest.guest);
        let expected: &[&str] = if guest.language == "python" {
            &["exports"]
        } else {
            &[]
        };
        assert_eq!(info.extra_exports, expected, "{}", guest.guest);
    }
    let described = inspect_component("runner", &PYTHON_RUNNER.wasm());
    assert_eq!(described["world"], World::Runner.name());
    assert_eq!(described["extra_exports"], json!(["exports"]));
}

/// `examples/polyglot` as its header says to run it, on a copy (so the
/// repository's `.dexa` is untouched): `dexa demo` with the Python runner
/// and both tools on the scripted model.
#[tokio::test]
async fn the_polyglot_example_runs_with_dexa_demo() {
    precompile_language_guests();
    let dir = tempfile::tempdir().unwrap();
    let config = example_copy(dir.path(), "polyglot");
    let message = "How many words are in: the quick brown fox jumps?";
    let (stdout, _) = run_demo(&config, &["--agent", "Polyglot", "--message", message], &[]).await;
    for line in [
        "(model: replay)",
        "[tool py_word_count call_count succeeded]",
        "[tool js_describe_call call_where succeeded]",
        r#"tool      {"words": 5, "greeting": "counted by Python"}"#,
        "agent> It has 5 words.",
        "[turn-1 completed]",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
}

/// componentize-js says only "failed to parse JS source" for a syntax
/// error; the JS build checks the source with Node first, which names the
/// file and line.
#[test]
fn a_js_syntax_error_is_reported_with_its_file_and_line_before_componentize_js_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("tool.js");
    std::fs::write(
        &bad,
        "export function listTools() {\n  return [ };\n}\nexport function call(c) { return \"x\"; }\n",
    )
    .expect("write");
    let check = repo_root().join("guests/js/check-syntax.sh");
    let output = std::process::Command::new(&check)
        .arg(&bad)
        .output()
        .expect("run check-syntax.sh");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{}:2", bad.display())) && stderr.contains("SyntaxError"),
        "the file, the line and the error: {stderr}"
    );
    // A guest that parses passes.
    let good = std::process::Command::new(&check)
        .arg(repo_root().join("guests/js/tool/tool.js"))
        .output()
        .expect("run check-syntax.sh");
    assert!(good.status.success(), "{good:?}");
}
