//! The HTTP API of `dexa serve`, over real HTTP on loopback: auth, every RPC,
//! typed errors with their status codes, the SSE stream and its resumption,
//! and the OpenAPI document.

use std::time::Duration;

use dexa_tests::api_contract::Contract;
use dexa_tests::api_server::{ApiServer, TEST_TOKEN};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use reqwest::StatusCode;
use serde_json::{json, Value};

const TOKEN: &str = TEST_TOKEN;

#[derive(Clone)]
struct Served {
    base: String,
    http: reqwest::Client,
    /// Every answer read through `call` or `send` is checked against it.
    contract: std::sync::Arc<Contract>,
    _server: std::sync::Arc<ApiServer>,
}

impl Served {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let verb = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut request = self.http.request(verb, self.url(path)).bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        self.contract.check(method, path, status.as_u16(), &value);
        (status, value)
    }

    async fn snapshot_until(&self, session: &str, accept: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..2000 {
            let (status, snapshot) = self
                .call("GET", &format!("/v1/sessions/{session}"), None)
                .await;
            if status == StatusCode::OK && accept(&snapshot) {
                return snapshot;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("session {session} never reached the expected state");
    }
}

/// `Helpdesk`: turn 1 asks for a tool that needs approval, then answers.
async fn serve() -> Served {
    serve_script(json!({"turns": [
        {"steps": [
            {"tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
            {"text": "paid", "deltas": ["pa", "id"]}
        ]},
        {"steps": [{"text": "hello again"}]}
    ]}))
    .await
}

/// `Helpdesk` playing `script`.
async fn serve_script(script: Value) -> Served {
    let server = ApiServer::helpdesk(script).await;
    let http = reqwest::Client::new();
    let document: Value = http
        .get(format!("{}/openapi.json", server.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    Served {
        base: server.base.clone(),
        http,
        contract: std::sync::Arc::new(Contract::new(document)),
        _server: std::sync::Arc::new(server),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_the_token_get_401_and_documents_are_public() {
    let served = serve().await;
    for (method, path) in [
        ("GET", "/v1/agents"),
        ("GET", "/v1/sessions/x"),
        ("POST", "/v1/agents/Helpdesk/sessions"),
    ] {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        for token in [None, Some("wrong"), Some("")] {
            let mut request = served.http.request(method.clone(), served.url(path));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.unwrap();
            assert_eq!(
                response.status(),
                StatusCode::UNAUTHORIZED,
                "{path} {token:?}"
            );
            assert_eq!(
                response
                    .headers()
                    .get("www-authenticate")
                    .and_then(|v| v.to_str().ok()),
                Some("Bearer")
            );
            let body: Value = response.json().await.unwrap();
            assert_eq!(body["error"]["code"], "unauthorized");
        }
    }
    let (status, agents) = served.call("GET", "/v1/agents", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(agents["agents"][0]["name"], "Helpdesk");
    let openapi = served
        .http
        .get(served.url("/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(openapi.status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_through_the_api_with_an_approval_messages_history_and_stop() {
    let served = serve().await;
    let (status, started) = served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s1", "message": "pay"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{started}");
    assert_eq!(started, json!({"session_id": "s1", "agent": "Helpdesk"}));

    let snapshot = served
        .snapshot_until("s1", |s| {
            s["pending_interrupts"]
                .as_array()
                .is_some_and(|p| !p.is_empty())
        })
        .await;
    assert_eq!(snapshot["agent"], "Helpdesk");
    let interrupt_id = snapshot["pending_interrupts"][0]["interrupt_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(interrupt_id, "turn-1/pay");
    let answer = json!({"interrupt_id": interrupt_id, "approved": true});
    let (status, resolved) = served
        .call("POST", "/v1/sessions/s1/interrupts", Some(answer.clone()))
        .await;
    assert_eq!(
        (status, resolved),
        (StatusCode::OK, json!({"resolved": true}))
    );
    let (status, again) = served
        .call("POST", "/v1/sessions/s1/interrupts", Some(answer.clone()))
        .await;
    assert_eq!(
        (status, again),
        (StatusCode::OK, json!({"resolved": false})),
        "answered before: no longer pending"
    );
    // An interrupt the session never raised is not "already answered".
    for unknown in ["turn-1/nope", "turn-9/pay", "", "pay"] {
        let (status, error) = served
            .call(
                "POST",
                "/v1/sessions/s1/interrupts",
                Some(json!({"interrupt_id": unknown, "approved": true})),
            )
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{unknown:?}: {error}");
        assert_eq!(error["error"]["code"], "interrupt_not_found", "{error}");
    }

    served
        .snapshot_until("s1", |s| {
            s["state"]["turn_count"] == 1 && s["state"]["active_turn_id"].is_null()
        })
        .await;
    let (status, mut queued) = served
        .call(
            "POST",
            "/v1/sessions/s1/messages",
            Some(json!({"text": "again"})),
        )
        .await;
    without_message_id(status, &mut queued);
    assert_eq!(
        (status, queued),
        (StatusCode::ACCEPTED, json!({"queued": true}))
    );
    let snapshot = served
        .snapshot_until("s1", |s| {
            s["state"]["turn_count"] == 2 && s["state"]["active_turn_id"].is_null()
        })
        .await;
    let texts: Vec<&str> = snapshot["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["text"].as_str())
        .collect();
    assert_eq!(
        texts,
        vec!["pay", "s1/turn-1/pay", "paid", "again", "hello again"]
    );

    let (status, page) = served
        .call(
            "GET",
            "/v1/sessions/s1/messages?after_sequence=1&limit=2",
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let sequences: Vec<u64> = page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["sequence"].as_u64().unwrap())
        .collect();
    assert_eq!(sequences, vec![2, 3]);
    assert_eq!(page["next_after_sequence"], 3);

    let (status, history) = served.call("GET", "/v1/sessions/s1/history", None).await;
    assert_eq!(status, StatusCode::OK);
    let steps: Vec<&str> = history["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["step_type"].as_str())
        .collect();
    assert!(
        steps.contains(&"CallSingleAttemptTool") && steps.contains(&"AwaitToolApproval"),
        "{steps:?}"
    );

    let (status, listed) = served
        .call("GET", "/v1/sessions?agent=Helpdesk", None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(listed["sessions"][0]["session_id"], "s1");
    assert_eq!(listed["sessions"][0]["status"], "running");

    let (status, stopped) = served.call("POST", "/v1/sessions/s1/stop", None).await;
    assert_eq!(
        (status, stopped),
        (StatusCode::OK, json!({"stopped": true}))
    );
    let (status, snapshot) = served.call("GET", "/v1/sessions/s1", None).await;
    assert_eq!(status, StatusCode::OK, "a stopped session is still served");
    assert_eq!(snapshot["flow_status"], "stopped");
    // Stopped: a raised interrupt is not pending, an unknown one still 404.
    let (status, late) = served
        .call("POST", "/v1/sessions/s1/interrupts", Some(answer))
        .await;
    assert_eq!((status, late), (StatusCode::OK, json!({"resolved": false})));
    let (status, _) = served
        .call(
            "POST",
            "/v1/sessions/s1/interrupts",
            Some(json!({"interrupt_id": "turn-1/nope", "approved": false})),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_typed_json_with_the_right_status() {
    let served = serve().await;
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "taken", "message": ""})),
        )
        .await;
    let long_id = "x".repeat(201);
    let cases: Vec<(&str, String, Option<Value>, StatusCode, &str)> = vec![
        (
            "POST",
            "/v1/agents/Nobody/sessions".into(),
            Some(json!({"message": "hi"})),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "POST",
            "/v1/agents/Helpdesk/sessions".into(),
            Some(json!({"session_id": "taken"})),
            StatusCode::CONFLICT,
            "already_exists",
        ),
        (
            "POST",
            "/v1/agents/Helpdesk/sessions".into(),
            Some(json!({"session_id": long_id})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "POST",
            "/v1/agents/Helpdesk/sessions".into(),
            Some(json!({"mesage": "typo"})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        // No body, so no JSON content type.
        (
            "POST",
            "/v1/agents/Helpdesk/sessions".into(),
            None,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            "GET",
            "/v1/sessions/nope".into(),
            None,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "POST",
            "/v1/sessions/nope/messages".into(),
            Some(json!({"text": "hi"})),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "POST",
            "/v1/sessions/taken/messages".into(),
            Some(json!({"text": "  "})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "POST",
            "/v1/sessions/taken/interrupts".into(),
            Some(json!({"approved": true})),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "GET",
            "/v1/sessions/taken/messages?limit=many".into(),
            None,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "GET",
            "/v1/sessions?agent=Nobody".into(),
            None,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        // A path parameter that is not UTF-8: axum's own rejection, as the
        // JSON error body like every other error.
        (
            "GET",
            "/v1/sessions/%FF%FE".into(),
            None,
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "GET",
            "/v1/nothing-here".into(),
            None,
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "DELETE",
            "/v1/sessions/taken".into(),
            None,
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
    ];
    for (method, path, body, status, code) in cases {
        let (got, error) = served.call(method, &path, body).await;
        assert_eq!(got, status, "{method} {path}: {error}");
        assert_eq!(error["error"]["code"], code, "{method} {path}: {error}");
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{error}"
        );
    }
    // A stopped session takes no more messages.
    served.call("POST", "/v1/sessions/taken/stop", None).await;
    let (status, error) = served
        .call(
            "POST",
            "/v1/sessions/taken/messages",
            Some(json!({"text": "hi"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{error}");
    assert_eq!(error["error"]["code"], "not_running");
    // Nothing above created a session or lost one.
    let (_, listed) = served.call("GET", "/v1/sessions", None).await;
    assert_eq!(listed["sessions"].as_array().map(Vec::len), Some(1));
}

/// Reads SSE events until `stop` accepts one; returns (id, type, data).
/// Opens the session's event stream (resuming after `last_event_id`),
/// checking that it is a 200 `text/event-stream`.
async fn open_sse(
    served: &Served,
    session: &str,
    last_event_id: Option<&str>,
) -> impl futures_util::Stream<
    Item = Result<eventsource_stream::Event, eventsource_stream::EventStreamError<reqwest::Error>>,
> {
    let mut request = served
        .http
        .get(served.url(&format!("/v1/sessions/{session}/events")))
        .bearer_auth(TOKEN);
    if let Some(id) = last_event_id {
        request = request.header("Last-Event-ID", id);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    response.bytes_stream().eventsource()
}

async fn read_sse(
    served: &Served,
    session: &str,
    last_event_id: Option<&str>,
    stop: impl Fn(&str) -> bool,
) -> Vec<(String, String, Value)> {
    let mut stream = open_sse(served, session, last_event_id).await;
    let mut seen = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(20), stream.next())
            .await
            .expect("an event within 20 s")
            .expect("the stream stays open")
            .expect("a well-formed event");
        let data: Value = serde_json::from_str(&event.data).unwrap();
        // Each event's data as the document types it.
        let schema = match event.event.as_str() {
            "session_ended" => "SessionEnded",
            _ => "AgentEvent",
        };
        served.contract.check_schema(schema, &data);
        let done = stop(&event.event);
        seen.push((event.id, event.event, data));
        if done {
            return seen;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_is_sse_and_resumes_after_last_event_id() {
    let served = serve().await;
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s1", "message": "pay"})),
        )
        .await;
    let first = read_sse(&served, "s1", None, |t| t == "interrupt_raised").await;
    let (last_id, _, _) = first.last().unwrap().clone();
    for (id, kind, data) in &first {
        assert_eq!(data["type"], kind.as_str(), "event {id}");
        assert!(id.parse::<i64>().is_ok());
    }
    let snapshot = served
        .snapshot_until("s1", |s| {
            s["pending_interrupts"]
                .as_array()
                .is_some_and(|p| !p.is_empty())
        })
        .await;
    let interrupt_id = snapshot["pending_interrupts"][0]["interrupt_id"].clone();
    served
        .call(
            "POST",
            "/v1/sessions/s1/interrupts",
            Some(json!({"interrupt_id": interrupt_id, "approved": true})),
        )
        .await;
    let resumed = read_sse(&served, "s1", Some(&last_id), |t| t == "turn_completed").await;
    let ids: Vec<i64> = resumed
        .iter()
        .map(|(id, _, _)| id.parse().unwrap())
        .collect();
    let last: i64 = last_id.parse().unwrap();
    assert!(
        ids.iter().all(|id| *id > last),
        "resumed after {last}: {ids:?}"
    );
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    let deltas: String = resumed
        .iter()
        .filter(|(_, t, _)| t == "text_delta")
        .filter_map(|(_, _, d)| d["data"]["text"].as_str())
        .collect();
    assert_eq!(deltas, "paid");
    let (status, error) = served
        .call("GET", "/v1/sessions/s1/events?after=soon", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_in_the_openapi_document_is_routed_and_every_ref_resolves() {
    let served = serve().await;
    let document: Value = served
        .http
        .get(served.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(document["openapi"], "3.1.0");
    let mut operations = 0;
    for (path, item) in document["paths"].as_object().unwrap() {
        for (method, _) in item.as_object().unwrap() {
            operations += 1;
            let concrete = path
                .replace("{agent}", "Helpdesk")
                .replace("{session_id}", "absent");
            let (status, body) = served
                .call(&method.to_uppercase(), &concrete, Some(json!({})))
                .await;
            let unrouted = status == StatusCode::METHOD_NOT_ALLOWED
                || body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("no such route"));
            assert!(
                !unrouted,
                "{method} {path} is documented but not routed: {status} {body}"
            );
        }
    }
    assert_eq!(operations, 16);
    fn refs(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, v) in map {
                    if key == "$ref" {
                        out.extend(v.as_str().map(str::to_string));
                    } else {
                        refs(v, out);
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&document, &mut all);
    assert!(!all.is_empty());
    for reference in all {
        let name = reference
            .strip_prefix("#/components/schemas/")
            .unwrap_or_else(|| panic!("{reference}"));
        assert!(
            document["components"]["schemas"].get(name).is_some(),
            "{reference} does not resolve"
        );
    }
}

impl Served {
    /// `POST /v1/sessions/{session}/messages`, with an `Idempotency-Key`
    /// header for each of `keys`.
    async fn send(&self, session: &str, text: &str, keys: &[&str]) -> (StatusCode, Value) {
        let mut request = self
            .http
            .post(self.url(&format!("/v1/sessions/{session}/messages")))
            .bearer_auth(TOKEN)
            .json(&json!({ "text": text }));
        for key in keys {
            request = request.header("Idempotency-Key", *key);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        let mut value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        self.contract.check(
            "POST",
            &format!("/v1/sessions/{session}/messages"),
            status.as_u16(),
            &value,
        );
        without_message_id(status, &mut value);
        (status, value)
    }

    /// Waits until the session has run at least `turns` turns and is idle:
    /// no turn running, no message queued.
    async fn idle_after(&self, session: &str, turns: u64) -> Value {
        self.snapshot_until(session, |s| {
            s["state"]["turn_count"]
                .as_u64()
                .is_some_and(|n| n >= turns)
                && s["state"]["active_turn_id"].is_null()
                && s["queued_message_count"] == 0
        })
        .await
    }
}

/// Takes the `message_id` out of a send's answer (a fresh id each send),
/// checking that a queued message has one.
fn without_message_id(status: StatusCode, answer: &mut Value) {
    if status != StatusCode::ACCEPTED {
        return;
    }
    let id = answer.as_object_mut().and_then(|a| a.remove("message_id"));
    assert!(
        id.as_ref()
            .and_then(Value::as_str)
            .is_some_and(|id| id.starts_with("msg-")),
        "a queued message has an id: {answer}"
    );
}

/// The texts of a snapshot's user messages, oldest first.
fn user_texts(snapshot: &Value) -> Vec<String> {
    snapshot["messages"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|m| m["role"] == "user")
        .filter_map(|m| m["text"].as_str().map(str::to_string))
        .collect()
}

/// The answer `send` gives a keyed send.
fn keyed(key: &str, replayed: bool) -> (StatusCode, Value) {
    (
        StatusCode::ACCEPTED,
        json!({"queued": true, "idempotency_key": key, "replayed": replayed}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_retried_with_one_idempotency_key_queues_one_message_and_another_key_another() {
    let served = serve_script(json!({"turns": [{"steps": [{"text": "ok"}]}]})).await;
    let (status, started) = served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s1"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{started}");

    // A client that timed out sends again at once, with the same key.
    let first = served.send("s1", "pay invoice 7", &["pay-7"]).await;
    let retry = served.send("s1", "pay invoice 7", &["pay-7"]).await;
    assert_eq!(first, keyed("pay-7", false));
    assert_eq!(
        retry,
        keyed("pay-7", true),
        "the retry gets the first answer"
    );
    let snapshot = served.idle_after("s1", 1).await;
    assert_eq!(user_texts(&snapshot), vec!["pay invoice 7"]);
    assert_eq!(
        snapshot["state"]["turn_count"], 1,
        "one turn ran: {snapshot}"
    );

    // A retry after the turn ran is recognised too, and runs nothing.
    let late = served.send("s1", "pay invoice 7", &["pay-7"]).await;
    assert_eq!(late, keyed("pay-7", true));
    // The same key with another text is no retry: refused, nothing queued.
    let (status, error) = served.send("s1", "pay invoice 8", &["pay-7"]).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{error}");
    assert_eq!(error["error"]["code"], "idempotency_key_reused");

    // Another key queues another message, even with the same text.
    let second = served.send("s1", "pay invoice 7", &["pay-7-again"]).await;
    assert_eq!(second, keyed("pay-7-again", false));
    let snapshot = served.idle_after("s1", 2).await;
    assert_eq!(
        user_texts(&snapshot),
        vec!["pay invoice 7", "pay invoice 7"]
    );
    assert_eq!(snapshot["state"]["turn_count"], 2, "{snapshot}");
    // A send without a key keeps its plain answer.
    let plain = served.send("s1", "no key", &[]).await;
    assert_eq!(plain, (StatusCode::ACCEPTED, json!({"queued": true})));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_idempotency_key_gets_a_typed_400_and_queues_nothing() {
    let served = serve_script(json!({"turns": [{"steps": [{"text": "ok"}]}]})).await;
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s1"})),
        )
        .await;
    let too_long = "k".repeat(256);
    let bad: Vec<(&str, Vec<&str>)> = vec![
        ("empty", vec![""]),
        ("256 bytes", vec![too_long.as_str()]),
        ("not ASCII", vec!["clé"]),
        ("a control character", vec!["tab\there"]),
        ("two headers", vec!["one", "two"]),
    ];
    for (why, keys) in bad {
        let (status, error) = served.send("s1", "pay", &keys).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{why}: {error}");
        assert_eq!(error["error"]["code"], "invalid_idempotency_key", "{why}");
    }
    // The longest valid key works, and it is the only message queued.
    let longest = "k".repeat(255);
    let queued = served.send("s1", "pay", &[longest.as_str()]).await;
    assert_eq!(queued, keyed(&longest, false));
    let snapshot = served.idle_after("s1", 1).await;
    assert_eq!(user_texts(&snapshot), vec!["pay"]);
    assert_eq!(snapshot["state"]["turn_count"], 1, "{snapshot}");
}

/// POSTs `body` over a bare HTTP/1.1 connection and returns the status and
/// the JSON answer. A server that refuses a body over its limit answers and
/// closes before reading the rest; an HTTP client can report that as a
/// broken connection instead of the answer, so this one ignores write
/// errors and reads whatever came back.
async fn raw_post(served: &Served, path: &str, body: &Value) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let address = served.base.trim_start_matches("http://").to_string();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {TOKEN}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
        let _ = stream.write_all(head.as_bytes()).await;
        let _ = stream.write_all(body.as_bytes()).await;
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer).await;
        answer
    };
    let answer = tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .expect("an answer within 20 s");
    let text = String::from_utf8_lossy(&answer).to_string();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {head:?}"));
    let value = serde_json::from_str(rest).unwrap_or(Value::String(rest.to_string()));
    (status, value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_gets_a_typed_413_queues_nothing_and_the_session_goes_on() {
    use dexa::api::MAX_REQUEST_BODY_BYTES;
    use dexa::session::MAX_USER_MESSAGE_BYTES;
    let served = serve_script(json!({"turns": [{"steps": [{"text": "ok"}]}]})).await;
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s1"})),
        )
        .await;

    // Just over the cap: the body is read whole, and the session client
    // refuses the message.
    let over = "x".repeat(MAX_USER_MESSAGE_BYTES + 1);
    let (status, error) = served.send("s1", &over, &[]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{error}");
    assert_eq!(error["error"]["code"], "message_too_large", "{error}");
    let (status, error) = served.send("s1", &over, &["big-1"]).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{error}");

    // 3 MiB: over the request-body limit too; still a typed JSON 413.
    let huge = "y".repeat(3 << 20);
    assert!(huge.len() > MAX_REQUEST_BODY_BYTES);
    let (status, error) = raw_post(
        &served,
        "/v1/sessions/s1/messages",
        &json!({ "text": huge }),
    )
    .await;
    assert_eq!(status, 413, "{error}");
    assert_eq!(error["error"]["code"], "payload_too_large", "{error}");

    // A session cannot start with one either, and none is created.
    let (status, error) = served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s2", "message": over})),
        )
        .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{error}");
    assert_eq!(error["error"]["code"], "message_too_large");
    let (status, _) = served.call("GET", "/v1/sessions/s2", None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // The session goes on: nothing was queued, and a normal message runs.
    let (status, snapshot) = served.call("GET", "/v1/sessions/s1", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(snapshot["queued_message_count"], 0, "{snapshot}");
    assert_eq!(snapshot["flow_status"], "running");
    let queued = served.send("s1", "hello", &[]).await;
    assert_eq!(queued, (StatusCode::ACCEPTED, json!({"queued": true})));
    let snapshot = served.idle_after("s1", 1).await;
    assert_eq!(user_texts(&snapshot), vec!["hello"]);
    assert_eq!(snapshot["state"]["turn_count"], 1, "{snapshot}");
    assert_eq!(snapshot["state"]["last_turn_error"], Value::Null);
}

/// An answer's header `name`, as text.
fn header(response: &reqwest::Response, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_carries_a_request_id_and_a_callers_id_is_kept() {
    let server = ApiServer::helpdesk(json!({"turns": []})).await;
    let http = reqwest::Client::new();
    let id = |response: &reqwest::Response| header(response, "x-request-id");
    // A new id for each request, on answers of every kind (401, 404, 200).
    let mut seen = std::collections::HashSet::new();
    for (path, token, status) in [
        ("/healthz", None, 200),
        ("/v1/agents", None, 401),
        ("/v1/agents", Some(TEST_TOKEN), 200),
        ("/nowhere", Some(TEST_TOKEN), 404),
    ] {
        let mut request = http.get(format!("{}{path}", server.base));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), status, "{path}");
        let given = id(&response).unwrap_or_else(|| panic!("{path}: no x-request-id"));
        assert_eq!(given.len(), 36, "a UUID: {given}");
        assert!(seen.insert(given), "ids repeat");
    }
    let response = http
        .get(format!("{}/healthz", server.base))
        .header("x-request-id", "caller-7")
        .send()
        .await
        .unwrap();
    assert_eq!(id(&response).as_deref(), Some("caller-7"));
    // An id that is long, or not a plain token, or given twice, is
    // replaced (it would be logged with every line of the request).
    for bad in ["x".repeat(129), "a b".to_string(), "<script>".to_string()] {
        let response = http
            .get(format!("{}/healthz", server.base))
            .header("x-request-id", bad.as_str())
            .send()
            .await
            .unwrap();
        let given = id(&response).unwrap();
        assert_ne!(given, bad);
        assert_eq!(given.len(), 36, "a new UUID: {given}");
    }
    let response = http
        .get(format!("{}/healthz", server.base))
        .header("x-request-id", "one")
        .header("x-request-id", "two")
        .send()
        .await
        .unwrap();
    assert_eq!(id(&response).map(|i| i.len()), Some(36));
    let response = http
        .get(format!("{}/healthz", server.base))
        .header("x-request-id", "x".repeat(128))
        .send()
        .await
        .unwrap();
    assert_eq!(
        id(&response),
        Some("x".repeat(128)),
        "128 characters are kept"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_json_is_a_415_and_one_too_large_a_413() {
    let server = ApiServer::helpdesk(json!({"turns": []})).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/agents/Helpdesk/sessions", server.base);
    for content_type in [
        None,
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
    ] {
        let mut request = http
            .post(&url)
            .bearer_auth(TEST_TOKEN)
            .body(r#"{"session_id": "m1", "message": ""}"#);
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 415, "{content_type:?}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["code"], "unsupported_media_type", "{error}");
    }
    let response = http
        .post(&url)
        .bearer_auth(TEST_TOKEN)
        .header("content-type", "application/json")
        .body(format!(
            r#"{{"session_id": "m1", "message": "{}"}}"#,
            "x".repeat(2 << 20)
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    // Nothing was started by any of them.
    let response = http
        .get(format!("{}/v1/sessions/m1", server.base))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
}

/// CORS is off by default: no answer lets another origin's page read it.
/// With `--cors-origin`, the listed origin's preflight (which carries no
/// token) is answered, and its requests are readable; others' are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_is_off_by_default_and_allows_only_the_configured_origins() {
    use dexa::api::cors::CorsOrigins;
    let http = reqwest::Client::new();
    let allow_origin =
        |response: &reqwest::Response| header(response, "access-control-allow-origin");
    let preflight = |base: &str, origin: &str| {
        http.request(reqwest::Method::OPTIONS, format!("{base}/v1/agents"))
            .header("origin", origin)
            .header("access-control-request-method", "GET")
            .header("access-control-request-headers", "authorization")
            .send()
    };
    let off = ApiServer::helpdesk(json!({"turns": []})).await;
    let response = preflight(&off.base, "https://app.example.com")
        .await
        .unwrap();
    assert_eq!(allow_origin(&response), None, "off by default");
    let response = http
        .get(format!("{}/v1/agents", off.base))
        .bearer_auth(TEST_TOKEN)
        .header("origin", "https://app.example.com")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(allow_origin(&response), None);

    let dir = tempfile::tempdir().unwrap();
    let config = dexa::config::DexaConfig::load(dexa_tests::api_server::helpdesk_config(
        dir.path(),
        &json!({"turns": []}),
    ))
    .unwrap();
    let deployment =
        std::sync::Arc::new(dexa::config::Deployment::for_clients(config).await.unwrap());
    let origins = CorsOrigins::parse(&["https://app.example.com".to_string()]).unwrap();
    let app = dexa::api::router(
        dexa::api::ApiState::new(
            deployment,
            Some(std::sync::Arc::new(TEST_TOKEN.to_string())),
        )
        .with_cors(origins),
    );
    let base = dexa_tests::api_server::serve_on_loopback(app).await;
    let response = preflight(&base, "https://app.example.com").await.unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    assert_eq!(
        allow_origin(&response).as_deref(),
        Some("https://app.example.com")
    );
    let allowed = response
        .headers()
        .get("access-control-allow-headers")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");
    let response = http
        .get(format!("{base}/v1/agents"))
        .bearer_auth(TEST_TOKEN)
        .header("origin", "https://app.example.com")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        allow_origin(&response).as_deref(),
        Some("https://app.example.com")
    );
    // The token is still needed; CORS only lets the page read the answer.
    let response = http
        .get(format!("{base}/v1/agents"))
        .header("origin", "https://app.example.com")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let response = preflight(&base, "https://evil.example").await.unwrap();
    assert_eq!(allow_origin(&response), None, "another origin");
}

/// Reads SSE events until the server ends the stream; returns (id, type,
/// data).
async fn read_sse_to_end(
    served: &Served,
    session: &str,
    last_event_id: Option<&str>,
) -> Vec<(String, String, Value)> {
    let mut stream = open_sse(served, session, last_event_id).await;
    let mut seen = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .unwrap_or_else(|_| panic!("the stream did not end; it sent {seen:?}"));
        let Some(event) = next else {
            return seen;
        };
        let event = event.expect("a well-formed event");
        let data: Value = serde_json::from_str(&event.data).unwrap();
        seen.push((event.id, event.event, data));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_sessions_event_stream_sends_every_event_then_session_ended_and_ends() {
    let served = serve().await;
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s1", "message": "pay"})),
        )
        .await;
    read_sse(&served, "s1", None, |t| t == "interrupt_raised").await;
    // A stream open when the session is stopped: it ends after the stop.
    let open = {
        let served = served.clone();
        tokio::spawn(async move { read_sse_to_end(&served, "s1", None).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _) = served.call("POST", "/v1/sessions/s1/stop", None).await;
    assert_eq!(status, StatusCode::OK);
    let seen = open.await.expect("the reader");
    let (last, rest) = seen.split_last().expect("events");
    assert_eq!(
        Some(&last.0),
        rest.last().map(|e| &e.0),
        "the end carries the last event's id: a reconnect resumes after it"
    );
    assert_eq!(last.1, "session_ended");
    assert_eq!(
        last.2,
        json!({"session_id": "s1", "status": "stopped", "error": null})
    );
    let kinds: Vec<&str> = rest.iter().map(|(_, kind, _)| kind.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"turn_started"), "{kinds:?}");
    assert!(kinds.contains(&"interrupt_raised"), "{kinds:?}");
    assert!(!kinds.contains(&"session_ended"), "{kinds:?}");
    // Opened after the stop: every event, then the end at once.
    let again = read_sse_to_end(&served, "s1", None).await;
    assert_eq!(again.len(), seen.len());
    assert_eq!(again.last().map(|e| e.1.as_str()), Some("session_ended"));
    // Resumed from the middle: the rest, then the end.
    let middle = &rest[rest.len() / 2].0;
    let resumed = read_sse_to_end(&served, "s1", Some(middle)).await;
    assert_eq!(resumed.len(), rest.len() - rest.len() / 2);
    // A reconnect with nothing left: 204, so that EventSource stops.
    let last_id = &rest.last().expect("an event").0;
    let response = served
        .http
        .get(served.url("/v1/sessions/s1/events"))
        .bearer_auth(TOKEN)
        .header("Last-Event-ID", last_id.as_str())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_or_blank_where_a_string_is_required_is_refused_and_limits_are_clamped() {
    let served = serve().await;
    for body in [
        json!({"session_id": null}),
        json!({"session_id": ""}),
        json!({"session_id": "   "}),
        json!({"session_id": "a\u{0007}b"}),
        json!({"message": null}),
    ] {
        let (status, error) = served
            .call("POST", "/v1/agents/Helpdesk/sessions", Some(body.clone()))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {error}");
    }
    let (_, listed) = served.call("GET", "/v1/sessions", None).await;
    assert_eq!(listed["sessions"], json!([]), "nothing was started");

    // A session of three messages; limits out of range are clamped.
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s1", "message": "pay"})),
        )
        .await;
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "s2", "message": ""})),
        )
        .await;
    let count = |page: &Value, key: &str| page[key].as_array().map_or(0, Vec::len);
    for (limit, sessions) in [
        ("0", 1),
        ("-5", 1),
        ("1", 1),
        ("100000", 2),
        ("9223372036854775807", 2),
    ] {
        let (status, page) = served
            .call("GET", &format!("/v1/sessions?limit={limit}"), None)
            .await;
        assert_eq!(status, StatusCode::OK, "limit={limit}: {page}");
        assert_eq!(count(&page, "sessions"), sessions, "limit={limit}: {page}");
    }
    served
        .snapshot_until("s1", |s| {
            s["pending_interrupts"]
                .as_array()
                .is_some_and(|p| !p.is_empty())
        })
        .await;
    served
        .call(
            "POST",
            "/v1/sessions/s1/interrupts",
            Some(json!({"interrupt_id": "turn-1/pay", "approved": true})),
        )
        .await;
    served
        .snapshot_until("s1", |s| {
            s["messages"].as_array().is_some_and(|m| m.len() >= 3)
        })
        .await;
    for body in [
        json!({"text": null}),
        json!({"text": ""}),
        json!({"text": " \n\t"}),
    ] {
        let (status, error) = served
            .call("POST", "/v1/sessions/s2/messages", Some(body.clone()))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {error}");
    }
    let (_, s2) = served.call("GET", "/v1/sessions/s2", None).await;
    assert_eq!(s2["queued_message_count"], 0, "nothing was queued: {s2}");
    for (limit, at_most) in [("0", 1), ("-1", 1), ("999999", 200)] {
        let (status, page) = served
            .call(
                "GET",
                &format!("/v1/sessions/s1/messages?limit={limit}"),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::OK, "limit={limit}: {page}");
        let n = count(&page, "messages");
        assert!(n >= 1 && n <= at_most, "limit={limit}: {page}");
        if at_most == 1 {
            assert_eq!(n, 1, "limit={limit} is clamped to 1");
        }
    }
    let (status, _) = served
        .call("GET", "/v1/sessions/s1/messages?limit=1e3", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "not an integer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_and_history_are_paged_by_cursor_without_a_gap_or_a_repeat() {
    let served = serve().await;
    for n in 0..7 {
        let (status, _) = served
            .call(
                "POST",
                "/v1/agents/Helpdesk/sessions",
                Some(json!({"session_id": format!("s{n}"), "message": ""})),
            )
            .await;
        assert_eq!(status, StatusCode::CREATED);
    }
    let (_, whole) = served.call("GET", "/v1/sessions", None).await;
    assert_eq!(whole["next_cursor"], Value::Null, "one page holds them all");
    let ids = |page: &Value| -> Vec<String> {
        page["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["session_id"].as_str().unwrap().to_string())
            .collect()
    };
    let expected = ids(&whole);
    assert_eq!(expected.len(), 7);
    let mut paged = Vec::new();
    let mut path = "/v1/sessions?limit=3".to_string();
    for _ in 0..10 {
        let (status, page) = served.call("GET", &path, None).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        assert!(ids(&page).len() <= 3);
        paged.extend(ids(&page));
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/v1/sessions?limit=3&cursor={cursor}"),
            None => break,
        }
    }
    assert_eq!(
        paged, expected,
        "pages of 3, in order, none twice, none missed"
    );
    let (status, error) = served
        .call("GET", "/v1/sessions?cursor=not-a-cursor", None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error["error"]["code"], "invalid_cursor");

    // The Step history of a turn with an approval, one entry a page.
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "h", "message": "pay"})),
        )
        .await;
    served
        .snapshot_until("h", |s| {
            s["pending_interrupts"]
                .as_array()
                .is_some_and(|p| !p.is_empty())
        })
        .await;
    let (_, history) = served.call("GET", "/v1/sessions/h/history", None).await;
    assert_eq!(history["next_after"], Value::Null);
    let steps = history["steps"].as_array().unwrap().clone();
    assert!(steps.len() >= 2, "{history}");
    let mut paged = Vec::new();
    let mut path = "/v1/sessions/h/history?limit=1".to_string();
    for _ in 0..steps.len() + 1 {
        let (status, page) = served.call("GET", &path, None).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        paged.extend(page["steps"].as_array().unwrap().iter().cloned());
        match page["next_after"].as_i64() {
            Some(after) => path = format!("/v1/sessions/h/history?limit=1&after={after}"),
            None => break,
        }
    }
    assert_eq!(paged, steps);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_session_with_no_events_ends_its_stream_and_a_reconnect_gets_204() {
    let served = serve().await;
    served
        .call(
            "POST",
            "/v1/agents/Helpdesk/sessions",
            Some(json!({"session_id": "quiet", "message": ""})),
        )
        .await;
    served.call("POST", "/v1/sessions/quiet/stop", None).await;
    let seen = read_sse_to_end(&served, "quiet", None).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        (seen[0].0.as_str(), seen[0].1.as_str()),
        ("0", "session_ended"),
        "an id, so that an EventSource reconnects with Last-Event-ID"
    );
    // What a browser does next: reconnect with the id it was given.
    let response = served
        .http
        .get(served.url("/v1/sessions/quiet/events"))
        .bearer_auth(TOKEN)
        .header("Last-Event-ID", "0")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    // With ?after= (no header): the end again, at once.
    let response = served
        .http
        .get(served.url("/v1/sessions/quiet/events?after=0"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = tokio::time::timeout(Duration::from_secs(30), response.text())
        .await
        .expect("the stream ends")
        .unwrap();
    assert!(body.contains("event: session_ended"), "{body}");
}
