//! The component host: loading, the fresh sandbox per call, host imports,
//! errors and the compiled-artifact cache.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dexa::plugin::wit::{
    DeferredToolExecution, MessageRole, ModelMessage, ModelRequest, ModelResponse, ToolCallRecord,
    ToolCallStatus, ToolEffect, ToolError, ToolPolicy, TurnOutcome, Usage,
};
use dexa::plugin::{
    CacheOutcome, CallEnv, CallError, ComponentSettings, DirAccess, EventWriter, Grants,
    GuestEvent, LoadError, MemoryHistory, ModelProvider, SandboxConfig, SandboxEngine, TurnInput,
};
use dexa::providers::ScriptedModelProvider;
use dexa::session::{ToolPolicies, ToolPolicyOverride};
use dexa_tests::{guest_bytes, step_tag, test_engine, CollectingEvents, CountingHeartbeats};

fn record(id: &str, tool: &str, arguments: &str, effect: ToolEffect) -> ToolCallRecord {
    ToolCallRecord {
        tool_call_id: id.to_string(),
        tool_name: tool.to_string(),
        arguments: arguments.to_string(),
        policy: ToolPolicy {
            effect,
            requires_approval: false,
        },
        status: ToolCallStatus::Approved,
        output: None,
        error: None,
        rejection_message: None,
        deferral_order: 0,
    }
}

fn execution(
    flow: &str,
    turn: &str,
    record: ToolCallRecord,
    attempt: u32,
) -> DeferredToolExecution {
    let idempotency_key = format!("{flow}/{turn}/{}", record.tool_call_id);
    DeferredToolExecution {
        flow_id: flow.to_string(),
        turn_id: turn.to_string(),
        tool_call: record,
        idempotency_key,
        attempt,
    }
}

fn env() -> CallEnv {
    CallEnv::new(step_tag("flow-1", "turn-1", "step-1", 1))
}

fn turn(
    turn_id: &str,
    user_text: &str,
    run_state: Option<String>,
    tool_calls: Vec<ToolCallRecord>,
) -> TurnInput {
    TurnInput {
        flow_id: "flow-1".to_string(),
        turn_id: turn_id.to_string(),
        attempt: 1,
        history: MemoryHistory::shared(vec![dexa::plugin::wit::AgentMessage {
            sequence: 1,
            turn_id: turn_id.to_string(),
            role: MessageRole::User,
            framework_item: "{}".to_string(),
            text: Some(user_text.to_string()),
        }]),
        compaction: None,
        framework_run_state: run_state,
        tool_calls,
        tools: Vec::new(),
    }
}

async fn load_tool(engine: &SandboxEngine, name: &str) -> dexa::plugin::ToolComponent {
    engine
        .load_tool(&guest_bytes(name), ComponentSettings::named(name))
        .await
        .unwrap_or_else(|err| panic!("{name}: {err}"))
}

fn load_runner(
    engine: &SandboxEngine,
    config: BTreeMap<String, String>,
) -> dexa::plugin::RunnerComponent {
    engine
        .load_runner(
            &guest_bytes("scripted-runner"),
            ComponentSettings::named("scripted-runner").with_config(config),
        )
        .unwrap_or_else(|err| panic!("scripted-runner: {err}"))
}

#[tokio::test]
async fn every_guest_loads_and_every_export_can_be_called() {
    let engine = test_engine();
    let expected_tools: [(&str, &[&str]); 5] = [
        ("tiny-tool", &["echo"]),
        (
            "echo-tool",
            &[
                "echo",
                "count_calls",
                "describe_call",
                "emit_events",
                "fail",
                "internal_fail",
                "trap",
                "spin",
            ],
        ),
        ("ledger-tool", &["record_payment"]),
        ("notify-tool", &["send_notification"]),
        ("files-tool", &["read_file", "write_file", "list_files"]),
    ];
    for (name, tools) in expected_tools {
        let component = load_tool(&engine, name).await;
        let listed: Vec<&str> = component.tools().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(listed, tools, "{name} list-tools");
        let again = component.list_tools(env()).await.expect("list-tools again");
        assert_eq!(again.len(), tools.len());
        // `call` answers for the first tool (files-tool without a grant answers
        // with an execution error, which is still an answer).
        let first = record(
            "c1",
            tools[0],
            r#"{"path":"a.txt","amount":1,"message":"hi"}"#,
            ToolEffect::Read,
        );
        let answer = component
            .call(env(), &execution("flow-1", "turn-1", first, 1))
            .await
            .unwrap_or_else(|err| panic!("{name} call: {err}"));
        if name == "files-tool" {
            assert!(
                matches!(answer, Err(ToolError::Execution(ref m)) if m.contains("no directory is granted")),
                "{answer:?}"
            );
        } else {
            assert!(answer.is_ok(), "{name}: {answer:?}");
        }
    }

    let runner = load_runner(&engine, BTreeMap::new());
    let message = runner
        .build_user_message(env(), "hello")
        .await
        .expect("build-user-message");
    assert_eq!(message.role, MessageRole::User);
    assert_eq!(message.text.as_deref(), Some("hello"));
    let outcome = runner
        .run_model_step(env(), turn("turn-1", "hello", None, Vec::new()))
        .await
        .expect("run-model-step")
        .expect("turn outcome");
    match outcome {
        TurnOutcome::Completed(done) => {
            assert_eq!(done.new_messages.len(), 1);
            assert_eq!(done.new_messages[0].text.as_deref(), Some("echo: hello"));
        }
        other => panic!("expected completed, got {other:?}"),
    }
    let deferred = runner
        .execute_deferred_tool_call(
            env(),
            &execution(
                "flow-1",
                "turn-1",
                record("c9", "lookup", "{}", ToolEffect::Read),
                1,
            ),
        )
        .await
        .expect("execute-deferred-tool-call")
        .expect("tool output");
    assert!(deferred.contains("scripted-runner"), "{deferred}");
}

#[tokio::test]
async fn each_call_gets_a_fresh_instance() {
    let engine = test_engine();
    let tool = load_tool(&engine, "echo-tool").await;
    for n in 0..5 {
        let output = tool
            .call(
                env(),
                &execution(
                    "flow-1",
                    "turn-1",
                    record(&format!("c{n}"), "count_calls", "{}", ToolEffect::Read),
                    1,
                ),
            )
            .await
            .expect("call")
            .expect("output");
        assert_eq!(output, "1", "call {n} saw state from an earlier call");
    }
}

#[tokio::test]
async fn idempotency_key_and_attempt_cross_the_boundary_unchanged() {
    let engine = test_engine();
    let tool = load_tool(&engine, "echo-tool").await;
    let exec = execution(
        "session-é/42",
        "turn-7",
        record(
            "call_ü-1",
            "describe_call",
            r#"{"a":[1,2]}"#,
            ToolEffect::Read,
        ),
        3,
    );
    let output = tool
        .call(env(), &exec)
        .await
        .expect("call")
        .expect("output");
    let seen: serde_json::Value = serde_json::from_str(&output).expect("json");
    assert_eq!(seen["idempotency_key"], "session-é/42/turn-7/call_ü-1");
    assert_eq!(seen["attempt"], 3);
    assert_eq!(seen["arguments"], r#"{"a":[1,2]}"#);

    // The idempotent-write tool records the key it was given in its granted dir.
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = engine
        .load_tool(
            &guest_bytes("ledger-tool"),
            ComponentSettings::named("ledger-tool").with_grants(Grants::none().dir(
                dir.path(),
                "/ledger",
                DirAccess::ReadWrite,
            )),
        )
        .await
        .expect("ledger-tool");
    for attempt in [1, 2] {
        let exec = execution(
            "flow-9",
            "turn-2",
            record(
                "pay-1",
                "record_payment",
                r#"{"amount":5}"#,
                ToolEffect::IdempotentWrite,
            ),
            attempt,
        );
        ledger
            .call(env(), &exec)
            .await
            .expect("call")
            .expect("output");
    }
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ledger dir")
        .filter_map(Result::ok)
        .collect();
    assert_eq!(
        files.len(),
        1,
        "a retried idempotent write must overwrite, not add"
    );
    let entry: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(files[0].path()).expect("entry"))
            .expect("json");
    assert_eq!(entry["idempotency_key"], "flow-9/turn-2/pay-1");
    assert_eq!(entry["attempt"], 2);

    // And through the runner's deferred tool path.
    let runner = load_runner(&engine, BTreeMap::new());
    let exec = execution(
        "flow-3",
        "turn-1",
        record("x", "lookup", "{}", ToolEffect::Read),
        2,
    );
    let output = runner
        .execute_deferred_tool_call(env(), &exec)
        .await
        .expect("call")
        .expect("output");
    let seen: serde_json::Value = serde_json::from_str(&output).expect("json");
    assert_eq!(seen["idempotency_key"], "flow-3/turn-1/x");
    assert_eq!(seen["attempt"], 2);
}

#[tokio::test]
async fn heartbeats_and_events_reach_the_host_with_the_step_tags() {
    let engine = test_engine();
    let tool = load_tool(&engine, "echo-tool").await;
    let events = Arc::new(CollectingEvents::default());
    let heartbeats = Arc::new(CountingHeartbeats::default());
    let tag = step_tag("flow-ev", "turn-4", "exec-77", 2);
    let env = CallEnv::new(tag.clone())
        .with_events(events.clone())
        .with_heartbeats(heartbeats.clone());
    let output = tool
        .call(
            env,
            &execution(
                "flow-ev",
                "turn-4",
                record("c1", "emit_events", "{}", ToolEffect::Read),
                2,
            ),
        )
        .await
        .expect("call")
        .expect("output");
    assert_eq!(output, "emitted");
    assert_eq!(heartbeats.count(), 1);
    assert_eq!(heartbeats.tags(), vec![tag.clone()]);
    let seen = events.events();
    assert!(
        seen.iter().all(|e| e.tag == tag),
        "every event carries the Step's tag"
    );
    let kinds: Vec<GuestEvent> = seen.into_iter().map(|e| e.event).collect();
    assert_eq!(
        kinds,
        vec![
            GuestEvent::TextDelta {
                text: "hello ".into()
            },
            GuestEvent::ReasoningDelta {
                text: "thinking".into()
            },
            GuestEvent::ToolCallStarted {
                tool_call_id: "c1".into(),
                tool_name: "inner".into()
            },
            GuestEvent::ToolCallFinished {
                tool_call_id: "c1".into(),
                tool_name: "inner".into(),
                status: "succeeded".into()
            },
            GuestEvent::Custom {
                event_type: "custom".into(),
                payload: serde_json::json!({"n": 1})
            },
        ]
    );

    // The runner's text deltas are tagged the same way.
    let runner = load_runner(&engine, BTreeMap::new());
    let events = Arc::new(CollectingEvents::default());
    let heartbeats = Arc::new(CountingHeartbeats::default());
    let tag = step_tag("flow-ev", "turn-1", "exec-run", 1);
    let script = r#"{"steps":[{"text":"ab","deltas":["a","b"],"heartbeat":true}]}"#;
    runner
        .run_model_step(
            CallEnv::new(tag.clone())
                .with_events(events.clone())
                .with_heartbeats(heartbeats.clone()),
            turn("turn-1", script, None, Vec::new()),
        )
        .await
        .expect("run")
        .expect("outcome");
    assert_eq!(heartbeats.tags(), vec![tag.clone()]);
    let deltas: Vec<_> = events
        .events()
        .into_iter()
        .map(|e| (e.tag, e.event))
        .collect();
    assert_eq!(
        deltas,
        vec![
            (tag.clone(), GuestEvent::TextDelta { text: "a".into() }),
            (tag, GuestEvent::TextDelta { text: "b".into() }),
        ]
    );
}

/// A scripted provider that keeps the call's event writer, to write through it
/// after the call has returned.
struct WriterKeepingModel {
    inner: ScriptedModelProvider,
    kept: Mutex<Option<EventWriter>>,
}

impl ModelProvider for WriterKeepingModel {
    fn complete<'a>(
        &'a self,
        request: ModelRequest,
        events: &'a EventWriter,
    ) -> dexa::plugin::factors::model::ModelFuture<'a> {
        if let Ok(mut kept) = self.kept.lock() {
            *kept = Some(events.clone());
        }
        self.inner.complete(request, events)
    }
}

fn model_answer(text: &str) -> ModelResponse {
    ModelResponse {
        message: ModelMessage {
            role: MessageRole::Assistant,
            content: Some(text.to_string()),
            tool_calls: Vec::new(),
            tool_call_id: None,
        },
        usage: Usage {
            input_tokens: 3,
            output_tokens: 2,
            total_tokens: 5,
        },
        finish_reason: "stop".to_string(),
    }
}

#[tokio::test]
async fn events_written_after_the_call_returned_are_dropped() {
    let engine = test_engine();
    let runner = load_runner(&engine, BTreeMap::new());
    let model = Arc::new(WriterKeepingModel {
        inner: ScriptedModelProvider::new([model_answer("from the model")]),
        kept: Mutex::new(None),
    });
    let events = Arc::new(CollectingEvents::default());
    let env = env().with_events(events.clone()).with_model(model.clone());
    let outcome = runner
        .run_model_step(
            env,
            turn("turn-1", r#"{"steps":[{"model":true}]}"#, None, Vec::new()),
        )
        .await
        .expect("run")
        .expect("outcome");
    let TurnOutcome::Completed(done) = outcome else {
        panic!("expected completed")
    };
    assert_eq!(done.new_messages[0].text.as_deref(), Some("from the model"));
    assert_eq!(done.usage.total_tokens, 5);
    let during = events.events().len();
    assert_eq!(
        during, 3,
        "the provider streamed three deltas during the call"
    );

    let kept = model
        .kept
        .lock()
        .expect("lock")
        .clone()
        .expect("writer kept");
    let late = kept.write(GuestEvent::TextDelta {
        text: "late".into(),
    });
    assert!(late.is_err());
    assert_eq!(
        events.events().len(),
        during,
        "a late event must not reach the sink"
    );
    assert_eq!(kept.dropped_after_close(), 1);
}

#[tokio::test]
async fn the_model_answers_once_per_run_model_step() {
    let engine = test_engine();
    let runner = load_runner(&engine, BTreeMap::new());
    let model = Arc::new(ScriptedModelProvider::new([
        model_answer("one"),
        model_answer("two"),
    ]));
    let outcome = runner
        .run_model_step(
            env().with_model(model.clone()),
            turn(
                "turn-1",
                r#"{"steps":[{"model":true,"model_twice":true}]}"#,
                None,
                Vec::new(),
            ),
        )
        .await
        .expect("run")
        .expect("outcome");
    let TurnOutcome::Completed(done) = outcome else {
        panic!("expected completed")
    };
    assert_eq!(
        done.new_messages[0].text.as_deref(),
        Some("one | second call: ModelError::AlreadyCalled")
    );
    assert_eq!(model.requests().len(), 1, "the provider saw one request");
    assert_eq!(
        model.requests()[0].messages[0].content.as_deref(),
        Some(r#"{"steps":[{"model":true,"model_twice":true}]}"#)
    );

    // Without a provider the runner gets a typed error, not a trap.
    let failed = runner
        .run_model_step(
            env(),
            turn("turn-1", r#"{"steps":[{"model":true}]}"#, None, Vec::new()),
        )
        .await
        .expect("run");
    let err = failed.expect_err("no model configured");
    assert!(err.contains("NotAvailable"), "{err}");
}

#[tokio::test]
async fn tool_policies_are_resolved_by_the_host() {
    let engine = test_engine();
    let runner = load_runner(&engine, BTreeMap::new());
    let mut policies = ToolPolicies::default();
    policies.explicit.insert(
        "refund".to_string(),
        ToolPolicyOverride {
            effect: ToolEffect::IdempotentWrite,
            requires_approval: Some(true),
        },
    );
    let script = r#"{"steps":[{"tool_calls":[
        {"id":"a","name":"refund","arguments":{"order":7},"effect":"read"},
        {"id":"b","name":"search","arguments":{},"effect":"read"},
        {"id":"c","name":"mystery","arguments":"raw"}
    ]}]}"#;
    let outcome = runner
        .run_model_step(
            env().with_policy(Arc::new(policies)),
            turn("turn-1", script, None, Vec::new()),
        )
        .await
        .expect("run")
        .expect("outcome");
    let TurnOutcome::ToolCallsRequested(requested) = outcome else {
        panic!("expected tool calls")
    };
    let policies: Vec<_> = requested
        .tool_calls
        .iter()
        .map(|c| {
            (
                c.tool_call_id.as_str(),
                c.policy.effect,
                c.policy.requires_approval,
            )
        })
        .collect();
    assert_eq!(
        policies,
        vec![
            ("a", ToolEffect::IdempotentWrite, true),
            ("b", ToolEffect::Read, false),
            ("c", ToolEffect::Unclassified, true),
        ]
    );
    assert_eq!(requested.tool_calls[0].arguments, r#"{"order":7}"#);
    assert_eq!(requested.tool_calls[2].arguments, "raw");
    assert!(!requested.framework_run_state.is_empty());

    // Resuming: the runner reads the final records through the host's
    // outcome rendering, and completes with every item in order.
    let mut done_records = Vec::new();
    for (order, (id, status, output, error)) in [
        ("a", ToolCallStatus::Succeeded, Some("refunded"), None),
        ("b", ToolCallStatus::Failed, None, Some("index offline")),
        ("c", ToolCallStatus::Rejected, None, None),
    ]
    .into_iter()
    .enumerate()
    {
        let mut r = record(id, "t", "{}", ToolEffect::Read);
        r.status = status;
        r.output = output.map(str::to_string);
        r.error = error.map(str::to_string);
        r.deferral_order = order as u32;
        done_records.push(r);
    }
    let script2 = r#"{"steps":[{"tool_calls":[{"id":"a","name":"x"}]},{"text":"all done"}]}"#;
    let resumed = runner
        .run_model_step(
            env().with_policy(Arc::new(ToolPolicies::default())),
            turn(
                "turn-1",
                script2,
                Some(requested.framework_run_state.clone()),
                done_records,
            ),
        )
        .await
        .expect("run")
        .expect("outcome");
    let TurnOutcome::Completed(done) = resumed else {
        panic!("expected completed")
    };
    let texts: Vec<_> = done
        .new_messages
        .iter()
        .map(|m| (m.role, m.text.clone()))
        .collect();
    assert_eq!(
        texts,
        vec![
            (MessageRole::Assistant, None),
            (MessageRole::Tool, Some("refunded".to_string())),
            (
                MessageRole::Tool,
                Some("Tool call failed: index offline".to_string())
            ),
            (
                MessageRole::Tool,
                Some("Tool call was rejected.".to_string())
            ),
            (MessageRole::Assistant, Some("all done".to_string())),
        ]
    );
}

#[tokio::test]
async fn a_trapping_guest_gives_a_typed_error_and_the_next_call_works() {
    let engine = test_engine();
    let tool = load_tool(&engine, "echo-tool").await;
    let err = tool
        .call(
            env(),
            &execution(
                "flow-1",
                "turn-1",
                record("c1", "trap", "{}", ToolEffect::Read),
                1,
            ),
        )
        .await
        .expect_err("a trap is a call error");
    match &err {
        CallError::Trapped {
            component,
            export,
            guest_stderr,
            ..
        } => {
            assert_eq!(component, "echo-tool");
            assert_eq!(*export, "call");
            assert!(
                guest_stderr.contains("echo-tool was asked to trap"),
                "{guest_stderr}"
            );
        }
        other => panic!("expected Trapped, got {other:?}"),
    }
    assert!(err.to_string().contains("was asked to trap"), "{err}");
    let ok = tool
        .call(
            env(),
            &execution(
                "flow-1",
                "turn-1",
                record("c2", "echo", "after", ToolEffect::Read),
                1,
            ),
        )
        .await
        .expect("the component still works")
        .expect("output");
    assert_eq!(ok, "after");

    // The runner's exports trap the same way.
    let runner = load_runner(&engine, BTreeMap::new());
    let err = runner
        .run_model_step(
            env(),
            turn(
                "turn-1",
                r#"{"steps":[{"text":"x","trap_attempts":1}]}"#,
                None,
                Vec::new(),
            ),
        )
        .await
        .expect_err("trap");
    assert!(
        matches!(
            err,
            CallError::Trapped {
                export: "run-model-step",
                ..
            }
        ),
        "{err:?}"
    );
    // A guest's own error result is not a trap.
    let failed = runner
        .run_model_step(
            env(),
            turn(
                "turn-1",
                r#"{"steps":[{"text":"x","fail_attempts":1}]}"#,
                None,
                Vec::new(),
            ),
        )
        .await
        .expect("no trap");
    assert_eq!(
        failed.expect_err("scripted failure"),
        "scripted failure on attempt 1"
    );
    let tool_errors = [("fail", true), ("internal_fail", false)];
    for (name, is_execution) in tool_errors {
        let answer = tool
            .call(
                env(),
                &execution(
                    "flow-1",
                    "turn-1",
                    record("c3", name, "boom", ToolEffect::Read),
                    1,
                ),
            )
            .await
            .expect("no trap");
        match answer {
            Err(ToolError::Execution(m)) if is_execution => assert!(m.contains("boom")),
            Err(ToolError::Internal(_)) if !is_execution => {}
            other => panic!("{name}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_guest_that_loops_is_stopped_at_its_deadline() {
    let engine = test_engine();
    let tool = load_tool(&engine, "echo-tool").await;
    let err = tool
        .call(
            env().with_timeout(Duration::from_millis(200)),
            &execution(
                "flow-1",
                "turn-1",
                record("c1", "spin", "{}", ToolEffect::Read),
                1,
            ),
        )
        .await
        .expect_err("a loop must be stopped");
    assert!(
        matches!(err, CallError::TimedOut { export: "call", timeout, .. } if timeout == Duration::from_millis(200)),
        "{err:?}"
    );
    let ok = tool
        .call(
            env(),
            &execution(
                "flow-1",
                "turn-1",
                record("c2", "echo", "still here", ToolEffect::Read),
                1,
            ),
        )
        .await
        .expect("next call works")
        .expect("output");
    assert_eq!(ok, "still here");
}

#[tokio::test]
async fn a_component_of_another_world_is_refused_at_load() {
    let engine = test_engine();
    let err = engine
        .load_tool(
            &guest_bytes("not-a-tool"),
            ComponentSettings::named("greeter"),
        )
        .await
        .err()
        .expect("refused");
    assert!(matches!(err, LoadError::WrongWorld { .. }), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("greeter") && message.contains("dex:agents/tool@0.2.0"),
        "{message}"
    );
    assert!(
        message.contains("`list-tools`, `call`") && message.contains("`greet`"),
        "{message}"
    );

    let err = engine
        .load_runner(
            &guest_bytes("echo-tool"),
            ComponentSettings::named("echo-as-runner"),
        )
        .err()
        .expect("a tool is not a runner");
    let message = err.to_string();
    assert!(
        message.contains("`build-user-message`") && message.contains("`list-tools`"),
        "{message}"
    );

    let err = engine
        .load_runner(b"definitely not wasm", ComponentSettings::named("junk"))
        .err()
        .expect("junk is refused");
    assert!(matches!(err, LoadError::Compile { .. }), "{err:?}");

    let err = engine
        .load_runner_file(
            std::path::Path::new("/nonexistent/runner.wasm"),
            ComponentSettings::named("gone"),
        )
        .err()
        .expect("missing file");
    assert!(
        err.to_string().contains("/nonexistent/runner.wasm"),
        "{err}"
    );
}

#[tokio::test]
async fn a_second_start_loads_the_cached_artifact_instead_of_compiling() {
    let cache = tempfile::tempdir().expect("tempdir");
    let config = SandboxConfig {
        cache_dir: Some(cache.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    let wasm = guest_bytes("echo-tool");

    let first = SandboxEngine::new(config.clone()).expect("engine");
    let tool = first
        .load_tool(&wasm, ComponentSettings::named("echo-tool"))
        .await
        .expect("load");
    assert_eq!(tool.info().cache, CacheOutcome::Compiled);
    assert_eq!(cache_entries(cache.path()).len(), 1);
    drop(tool);
    drop(first);

    // A new engine, as after a restart.
    let second = SandboxEngine::new(config).expect("engine");
    let tool = second
        .load_tool(&wasm, ComponentSettings::named("echo-tool"))
        .await
        .expect("load");
    assert_eq!(tool.info().cache, CacheOutcome::Hit);
    assert_eq!(tool.info().sha256.len(), 64);
    let output = tool
        .call(
            env(),
            &execution(
                "f",
                "turn-1",
                record("c", "echo", "cached", ToolEffect::Read),
                1,
            ),
        )
        .await
        .expect("call")
        .expect("output");
    assert_eq!(output, "cached");

    // A corrupt entry is recompiled, not trusted.
    for entry in cache_entries(cache.path()) {
        std::fs::write(entry, b"garbage").expect("corrupt");
    }
    let third = SandboxEngine::new(SandboxConfig {
        cache_dir: Some(cache.path().to_path_buf()),
        ..SandboxConfig::default()
    })
    .expect("engine");
    let tool = third
        .load_tool(&wasm, ComponentSettings::named("echo-tool"))
        .await
        .expect("load");
    assert_eq!(tool.info().cache, CacheOutcome::Recompiled);
}

/// The compiled components in a cache directory (not its key).
fn cache_entries(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .expect("cache dir")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cwasm"))
        .collect()
}

#[tokio::test]
async fn a_cache_entry_swapped_for_another_component_s_is_refused_and_its_code_never_runs() {
    let cache = tempfile::tempdir().expect("tempdir");
    let config = SandboxConfig {
        cache_dir: Some(cache.path().to_path_buf()),
        ..SandboxConfig::default()
    };
    let (echo, tiny) = (guest_bytes("echo-tool"), guest_bytes("tiny-tool"));
    let engine = SandboxEngine::new(config.clone()).expect("engine");
    let echo_tools = engine
        .load_tool(&echo, ComponentSettings::named("echo-tool"))
        .await
        .expect("load echo-tool")
        .tools()
        .len();
    let before = cache_entries(cache.path());
    engine
        .load_tool(&tiny, ComponentSettings::named("tiny-tool"))
        .await
        .expect("load tiny-tool");
    drop(engine);
    let tiny_entry = cache_entries(cache.path())
        .into_iter()
        .find(|path| !before.contains(path))
        .expect("tiny-tool's entry");
    // The attacker's move: tiny-tool's valid entry under echo-tool's name.
    std::fs::copy(&tiny_entry, &before[0]).expect("swap the entry");

    let engine = SandboxEngine::new(config).expect("engine");
    let tool = engine
        .load_tool(&echo, ComponentSettings::named("echo-tool"))
        .await
        .expect("load echo-tool again");
    // `list-tools` ran at load: echo-tool's code answered, not tiny-tool's
    // (which serves one tool, `echo`).
    assert_eq!(tool.tools().len(), echo_tools, "{:?}", tool.tools());
    assert!(tool.serves("count_calls"));
    assert_eq!(tool.info().cache, CacheOutcome::Recompiled);
}

#[tokio::test]
async fn a_directory_grant_is_the_only_filesystem_a_tool_sees() {
    let engine = test_engine();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("hello.txt"), "hi from the host").expect("seed");
    let files = engine
        .load_tool(
            &guest_bytes("files-tool"),
            ComponentSettings::named("files-tool").with_grants(Grants::none().dir(
                dir.path(),
                "/workspace",
                DirAccess::ReadWrite,
            )),
        )
        .await
        .expect("files-tool");
    let call = |name: &str, args: &str| {
        execution("f", "turn-1", record("c", name, args, ToolEffect::Read), 1)
    };
    let read = files
        .call(env(), &call("read_file", r#"{"path":"hello.txt"}"#))
        .await
        .expect("call");
    assert!(
        matches!(&read, Ok(text) if text == "hi from the host"),
        "{read:?}"
    );
    let wrote = files
        .call(
            env(),
            &call("write_file", r#"{"path":"out.txt","content":"written"}"#),
        )
        .await
        .expect("call");
    assert!(wrote.is_ok(), "{wrote:?}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out.txt")).expect("out"),
        "written"
    );
    let listed = files
        .call(env(), &call("list_files", r#"{"path":"."}"#))
        .await
        .expect("call");
    assert!(
        matches!(&listed, Ok(text) if text == "hello.txt\nout.txt"),
        "{listed:?}"
    );

    // Read-only grants refuse writes.
    let readonly = engine
        .load_tool(
            &guest_bytes("files-tool"),
            ComponentSettings::named("files-ro").with_grants(Grants::none().dir(
                dir.path(),
                "/workspace",
                DirAccess::ReadOnly,
            )),
        )
        .await
        .expect("files-tool");
    let refused = readonly
        .call(
            env(),
            &call("write_file", r#"{"path":"x.txt","content":"no"}"#),
        )
        .await
        .expect("call");
    assert!(
        matches!(refused, Err(ToolError::Execution(ref m)) if m.contains("cannot write")),
        "{refused:?}"
    );
    assert!(!dir.path().join("x.txt").exists());

    // A grant of a directory that does not exist is refused at load.
    let err = engine
        .load_tool(
            &guest_bytes("files-tool"),
            ComponentSettings::named("files-bad").with_grants(Grants::none().dir(
                "/nonexistent/dexa",
                "/workspace",
                DirAccess::ReadOnly,
            )),
        )
        .await
        .err()
        .expect("bad grant");
    assert!(matches!(err, LoadError::Grant { .. }), "{err:?}");
}

#[tokio::test]
async fn a_tool_whose_parameter_schema_is_invalid_is_refused_at_load_with_the_schema_error() {
    let engine = test_engine();
    let load = |schema: &str| {
        let settings = ComponentSettings::named("hostile-tool").with_config(BTreeMap::from([(
            "parameters_schema".to_string(),
            schema.to_string(),
        )]));
        let engine = engine.clone();
        async move {
            engine
                .load_tool(&guest_bytes("hostile-tool"), settings)
                .await
        }
    };
    let ok = load(r#"{"type":"object","properties":{"n":{"type":"integer"}}}"#)
        .await
        .expect("a valid schema loads");
    assert!(ok
        .tools()
        .iter()
        .all(|t| t.parameters_schema.contains("integer")));
    for (schema, says) in [
        (
            r#"{"type":"object","properties":{"n":{"type":"integr"}}}"#,
            "is not a valid JSON Schema: at /properties/n/type",
        ),
        ("{\"type\": \"object\"", "is not JSON"),
        (r#"{"type":"string"}"#, "must describe one JSON object"),
        (r#"{"properties":{}}"#, "has no \"type\""),
    ] {
        let err = match load(schema).await {
            Ok(_) => panic!("{schema} loaded"),
            Err(err) => err.to_string(),
        };
        assert!(
            err.contains("component `hostile-tool`: tool `spin`'s parameters schema")
                && err.contains(says),
            "{schema}: {err}"
        );
    }
    // A version sessions already use, accepted before the check: loaded,
    // with a warning, rather than stranding them.
    let mut settings = ComponentSettings::named("hostile-tool").with_config(BTreeMap::from([(
        "parameters_schema".to_string(),
        "{}".to_string(),
    )]));
    settings.keep_bad_tool_schemas = true;
    let kept = engine
        .load_tool(&guest_bytes("hostile-tool"), settings)
        .await
        .expect("kept");
    assert!(kept.serves("spin"));
}

/// What `hostile-tool`'s `print` wrote, by stream: (text, dropped bytes).
fn guest_logs(
    events: &CollectingEvents,
    tag: &dexa::plugin::StepTag,
) -> Vec<(String, String, u64)> {
    events
        .events()
        .into_iter()
        .filter_map(|e| match e.event {
            GuestEvent::GuestLog {
                component,
                stream,
                text,
                dropped_bytes,
            } => {
                assert_eq!(&e.tag, tag, "a guest log carries the Step's tag");
                assert_eq!(component, "hostile-tool");
                Some((stream, text, dropped_bytes))
            }
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_guests_stdout_and_stderr_become_guest_log_events_kept_to_a_cap_and_never_fail_it() {
    let engine = test_engine();
    let tool = load_tool(&engine, "hostile-tool").await;
    let cap = dexa::plugin::ComponentLimits::default().log_bytes;
    for megabytes in [0usize, 2] {
        let events = Arc::new(CollectingEvents::default());
        let tag = step_tag("flow-log", "turn-1", "exec-1", 1);
        let env = CallEnv::new(tag.clone()).with_events(events.clone());
        let arguments = format!("{{\"megabytes\": {megabytes}}}");
        let output = tool
            .call(
                env,
                &execution(
                    "flow-log",
                    "turn-1",
                    record("c1", "print", &arguments, ToolEffect::Read),
                    1,
                ),
            )
            .await
            .expect("a guest that prints past the cap is not failed")
            .expect("output");
        assert_eq!(output, "printed");
        let logs = guest_logs(&events, &tag);
        let streams: Vec<&str> = logs.iter().map(|(s, _, _)| s.as_str()).collect();
        assert_eq!(
            streams,
            ["stderr", "stdout"],
            "{megabytes} MiB: stderr first"
        );
        let (_, stderr, stderr_dropped) = &logs[0];
        let (_, stdout, stdout_dropped) = &logs[1];
        assert!(stdout.starts_with("stdout: first line\n"), "{stdout:.100}");
        assert!(
            stderr.starts_with("stderr: first line\n\u{fffd}\u{fffd}\n"),
            "bytes that are not UTF-8 become replacement characters: {stderr:.100}"
        );
        if megabytes == 0 {
            assert_eq!((*stdout_dropped, *stderr_dropped), (0, 0));
        } else {
            // Kept up to the cap (in bytes of the guest's output), the rest
            // counted, not stored.
            let written = (megabytes << 20) as u64;
            for (text, dropped) in [(stdout, stdout_dropped), (stderr, stderr_dropped)] {
                assert!(text.len() <= cap + 8, "{}", text.len());
                assert!(*dropped >= written - cap as u64, "{dropped}");
            }
        }
    }
}
