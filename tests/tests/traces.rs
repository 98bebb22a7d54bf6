//! Traces: a `dexa worker` process with `OTEL_EXPORTER_OTLP_ENDPOINT` set
//! exports, over OTLP/HTTP (JSON) to a collector stand-in on loopback, one
//! trace per turn: the turn's span, a child of the W3C `traceparent` the
//! message was sent with, and one span per Step attempt under it, tagged
//! with the session, turn, step execution, attempt, component and outcome.
//! The API (in the test process) and the worker are different processes:
//! the turn's trace travels through the store.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use dexa::api::{router, ApiState};
use dexa::config::{Deployment, DexaConfig};
use dexa::flow::{history, StepHistoryEntry};
use dexa_tests::api_server::{serve_on_loopback, TEST_TOKEN};
use dexa_tests::kit::{wait_until, AgentTestStack, KitAgent};
use serde_json::{json, Value};

/// What the collector stand-in received: each request's JSON body.
type Received = Arc<Mutex<Vec<Value>>>;

/// An OTLP/HTTP receiver on loopback: `POST /v1/traces` with a JSON
/// `ExportTraceServiceRequest`. Answers as a collector does (an empty
/// partial-success object).
async fn collector() -> (String, Received) {
    let received: Received = Arc::default();
    let kept = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let kept = kept.clone();
            async move {
                let parsed: Value = serde_json::from_slice(&body)
                    .unwrap_or_else(|err| panic!("the exporter sent no JSON ({err})"));
                kept.lock().unwrap().push(parsed);
                axum::Json(json!({}))
            }
        }),
    );
    let base = serve_on_loopback(app).await;
    (base, received)
}

/// One received span.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    name: String,
    attributes: BTreeMap<String, String>,
    error: bool,
}

/// An OTLP/JSON attribute value as text (int64 is a string in proto3 JSON;
/// take a number too).
fn attribute_text(value: &Value) -> String {
    for kind in ["stringValue", "intValue", "boolValue", "doubleValue"] {
        match value.get(kind) {
            Some(Value::String(text)) => return text.clone(),
            Some(other) if !other.is_null() => return other.to_string(),
            _ => {}
        }
    }
    panic!("an attribute value of no known kind: {value}")
}

fn attributes(list: Option<&Value>) -> BTreeMap<String, String> {
    list.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|kv| {
            (
                kv["key"].as_str().unwrap().to_string(),
                attribute_text(&kv["value"]),
            )
        })
        .collect()
}

fn spans(received: &Received) -> Vec<Span> {
    let mut spans = Vec::new();
    for request in received.lock().unwrap().iter() {
        for resource in request["resourceSpans"].as_array().into_iter().flatten() {
            let service = attributes(resource["resource"].get("attributes"))
                .remove("service.name")
                .unwrap_or_default();
            for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                for span in scope["spans"].as_array().into_iter().flatten() {
                    let text = |key: &str| span[key].as_str().unwrap_or_default().to_string();
                    spans.push(Span {
                        service: service.clone(),
                        trace_id: text("traceId"),
                        span_id: text("spanId"),
                        parent_span_id: text("parentSpanId"),
                        name: text("name"),
                        attributes: attributes(span.get("attributes")),
                        // STATUS_CODE_ERROR is 2 (or its name).
                        error: matches!(
                            span["status"].get("code"),
                            Some(code) if code == 2 || code == "STATUS_CODE_ERROR"
                        ),
                    });
                }
            }
        }
    }
    spans
}

/// The turn span of `trace_id`, once it arrived.
async fn turn_span(received: &Received, trace_id: &str) -> Span {
    wait_until(
        &format!("the turn span of trace {trace_id}"),
        Duration::from_secs(30),
        || {
            let found = spans(received)
                .into_iter()
                .find(|s| s.trace_id == trace_id && s.name == "turn");
            async move { found }
        },
    )
    .await
}

struct Traced {
    stack: AgentTestStack,
    base: String,
    http: reqwest::Client,
    received: Received,
}

impl Traced {
    async fn start() -> Self {
        let (collector, received) = collector().await;
        let agent = KitAgent::scripted(
            "Traced",
            json!({"turns": [
                {"steps": [
                    {"tool_calls": [{"id": "l", "name": "log", "arguments": {"name": "traced"}}]},
                    {"text": "logged"}
                ]},
                {"steps": [{"text": "two"}]},
                {"steps": [{"text": "three"}]},
                {"steps": [{"text": "four"}]}
            ]}),
        )
        .tool("gate-tool")
        .policy("log", dexa::session::ToolEffect::Read, None);
        let mut stack = AgentTestStack::new(vec![agent]);
        stack.start_worker_with_env(
            &[],
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.as_str()),
                // The SDK's batch delay, in ms (5 s by default).
                ("OTEL_BSP_SCHEDULE_DELAY", "50"),
                ("OTEL_SERVICE_NAME", "dexa-traces-test"),
            ],
        );
        let config = DexaConfig::load(&stack.config_path).unwrap();
        let api = Deployment::for_clients(config).await.unwrap();
        let app = router(ApiState::new(
            Arc::new(api),
            Some(Arc::new(TEST_TOKEN.to_string())),
        ));
        let base = serve_on_loopback(app).await;
        Self {
            stack,
            base,
            http: reqwest::Client::new(),
            received,
        }
    }

    /// Sends `text` with `traceparent` (if any) and waits for its turn.
    async fn send(&self, session: &str, text: &str, traceparent: Option<&str>) -> Value {
        let mut request = self
            .http
            .post(format!(
                "{}/v1/sessions/{session}/messages?wait=60",
                self.base
            ))
            .bearer_auth(TEST_TOKEN)
            .json(&json!({"text": text}));
        if let Some(traceparent) = traceparent {
            request = request.header("traceparent", traceparent);
        }
        let response = request.send().await.unwrap();
        assert_eq!(
            response.status(),
            200,
            "the turn of {text:?} did not complete"
        );
        response.json().await.unwrap()
    }

    async fn history(&self, session: &str) -> Vec<StepHistoryEntry> {
        self.stack.read_step_history(session).await
    }
}

/// The committed Steps of the history entries after `skip`, as (step
/// type, step execution id, component).
fn committed(history: &[StepHistoryEntry], skip: usize) -> Vec<(String, String, Option<String>)> {
    history[skip..]
        .iter()
        .filter(|e| e.event_type == history::EXECUTE_COMPLETED)
        .map(|e| {
            (
                e.step_type.clone(),
                e.step_execution_id.clone(),
                e.component.clone(),
            )
        })
        .collect()
}

/// Checks that the Step spans of `turn` are exactly `expected` (the
/// history's commits of the turn), children of the turn span, tagged.
fn assert_step_spans(
    all: &[Span],
    turn: &Span,
    session: &str,
    turn_id: &str,
    expected: &[(String, String, Option<String>)],
) {
    let mut steps: Vec<&Span> = all
        .iter()
        .filter(|s| s.trace_id == turn.trace_id && s.name != "turn")
        .collect();
    steps.sort_by_key(|s| {
        expected
            .iter()
            .position(|(_, id, _)| Some(id) == s.attributes.get("dexa.step_execution_id"))
    });
    assert_eq!(
        steps.len(),
        expected.len(),
        "one span per attempt of the turn's Steps: {steps:#?} against {expected:#?}"
    );
    for (span, (step_type, execution, component)) in steps.iter().zip(expected) {
        assert_eq!(&span.name, step_type);
        assert_eq!(span.parent_span_id, turn.span_id, "{span:?}");
        assert_eq!(span.service, "dexa-traces-test");
        let tag = |key: &str| span.attributes.get(key).map(String::as_str);
        assert_eq!(tag("dexa.session"), Some(session));
        assert_eq!(tag("dexa.turn"), Some(turn_id));
        assert_eq!(tag("dexa.step"), Some(step_type.as_str()));
        assert_eq!(tag("dexa.step_execution_id"), Some(execution.as_str()));
        assert_eq!(tag("dexa.attempt"), Some("1"));
        assert_eq!(tag("dexa.outcome"), Some("committed"));
        assert_eq!(tag("dexa.component"), component.as_deref(), "{span:?}");
        assert!(!span.error, "{span:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_is_one_trace_under_the_senders_traceparent_with_one_span_per_step_attempt() {
    let traced = Traced::start().await;
    let started = traced
        .http
        .post(format!("{}/v1/agents/Traced/sessions", traced.base))
        .bearer_auth(TEST_TOKEN)
        .json(&json!({"session_id": "t1", "message": ""}))
        .send()
        .await
        .unwrap();
    assert_eq!(started.status(), 201);
    wait_until("the session's start", Duration::from_secs(30), || {
        let history = traced.history("t1");
        async move { (!committed(&history.await, 0).is_empty()).then_some(()) }
    })
    .await;

    // Turn 1, sent under the caller's span.
    let trace_id = "4bf92f3577b34a0e00f10000000000a1";
    let caller_span = "00f067aa0ba902b7";
    let before = traced.history("t1").await.len();
    traced
        .send(
            "t1",
            "log it",
            Some(&format!("00-{trace_id}-{caller_span}-01")),
        )
        .await;
    let turn = turn_span(&traced.received, trace_id).await;
    assert_eq!(turn.parent_span_id, caller_span, "{turn:?}");
    assert_eq!(turn.attributes["dexa.session"], "t1");
    assert_eq!(turn.attributes["dexa.turn"], "turn-1");
    assert_eq!(turn.attributes["dexa.outcome"], "completed");
    let history = traced.history("t1").await;
    let expected = committed(&history, before);
    let types: Vec<&str> = expected.iter().map(|(t, _, _)| t.as_str()).collect();
    assert_eq!(
        types,
        [
            "AwaitUserMessage",
            "RunModel",
            "CallTool",
            "ResumeTurn",
            "RunModel"
        ]
    );
    assert!(expected[1].2.as_ref().is_some_and(|d| d.len() == 64));
    assert!(expected[2].2.is_some(), "the tool's digest");
    // The turn span is reported at the last commit; the Steps' spans with
    // or before it, in the same batch or an earlier one.
    let all = wait_until("the turn's Step spans", Duration::from_secs(30), || {
        let all = spans(&traced.received);
        let count = all.iter().filter(|s| s.trace_id == trace_id).count();
        let wanted = expected.len();
        async move { (count > wanted).then_some(all) }
    })
    .await;
    assert_step_spans(&all, &turn, "t1", "turn-1", &expected);

    // Turn 2, sent with no traceparent: a trace of its own, rooted at the
    // turn's span.
    let before = history.len();
    traced.send("t1", "again", None).await;
    let history = traced.history("t1").await;
    let expected = committed(&history, before);
    let all = wait_until("turn 2's spans", Duration::from_secs(30), || {
        let all = spans(&traced.received);
        let found = all.iter().any(|s| {
            s.name == "turn" && s.attributes.get("dexa.turn").map(String::as_str) == Some("turn-2")
        });
        async move { found.then_some(all) }
    })
    .await;
    let turn2 = all
        .iter()
        .find(|s| s.name == "turn" && s.attributes["dexa.turn"] == "turn-2")
        .unwrap()
        .clone();
    assert_ne!(turn2.trace_id, trace_id);
    assert_eq!(turn2.parent_span_id, "", "a new trace's turn has no parent");
    let all = wait_until("turn 2's Step spans", Duration::from_secs(30), || {
        let all = spans(&traced.received);
        let count = all.iter().filter(|s| s.trace_id == turn2.trace_id).count();
        let wanted = expected.len();
        async move { (count > wanted).then_some(all) }
    })
    .await;
    assert_step_spans(&all, &turn2, "t1", "turn-2", &expected);

    // Turn 3, sent with a traceparent that says not to record: nothing of
    // it is exported. Turn 4 (recorded) comes after it in the same queue,
    // so once turn 4's span is in, turn 3's would be too.
    let unsampled = "4bf92f3577b34a0e00f10000000000a3";
    traced
        .send(
            "t1",
            "quiet",
            Some(&format!("00-{unsampled}-{caller_span}-00")),
        )
        .await;
    let recorded = "4bf92f3577b34a0e00f10000000000a4";
    traced
        .send(
            "t1",
            "loud",
            Some(&format!("00-{recorded}-{caller_span}-01")),
        )
        .await;
    turn_span(&traced.received, recorded).await;
    // Neither in its trace nor as traces of their own.
    let leaked: Vec<Span> = spans(&traced.received)
        .into_iter()
        .filter(|s| {
            s.trace_id == unsampled
                || s.attributes.get("dexa.turn").map(String::as_str) == Some("turn-3")
        })
        .collect();
    assert!(
        leaked.is_empty(),
        "an unsampled turn was exported: {leaked:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dexa_serve_logs_each_request_with_its_id_status_and_path_and_never_the_token() {
    let server =
        dexa_tests::serve_process::ServeProcess::start(1024, &[("RUST_LOG", "info")], &[]).await;
    let http = reqwest::Client::new();
    let response = http
        .get(format!("http://{}/v1/agents?limit=1", server.address))
        .bearer_auth(TEST_TOKEN)
        .header("x-request-id", "probe-4711")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let line = wait_until("the request's log line", Duration::from_secs(10), || {
        let line = server
            .stderr()
            .lines()
            .find(|line| line.contains("probe-4711"))
            .map(str::to_string);
        async move { line }
    })
    .await;
    for part in ["status=200", "method=GET", "path=/v1/agents", "latency="] {
        assert!(line.contains(part), "{part} is not in {line:?}");
    }
    let printed = server.stderr();
    assert!(
        !printed.contains(TEST_TOKEN),
        "the token was logged:\n{printed}"
    );
    assert!(
        !printed.contains("limit=1"),
        "the query was logged:\n{printed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_an_otlp_protocol_it_does_not_speak_at_start() {
    let stack = AgentTestStack::new(vec![KitAgent::scripted("Traced", json!({"turns": []}))]);
    let output = tokio::process::Command::new(dexa_tests::kit::dexa_binary())
        .args(["worker", "--config"])
        .arg(&stack.config_path)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .env_remove("OTEL_SDK_DISABLED")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL=\"grpc\"")
            && stderr.contains("http/json only"),
        "{stderr}"
    );
}
