//! The OpenAPI 3.1 document served at `/openapi.json`. The operations are
//! listed here, each naming the Rust types its handler takes and answers
//! with; their schemas are derived from those types ([`schemas`]), so the
//! document cannot say a field the handlers do not send. Tests check that
//! every operation it lists is routed, that every `$ref` resolves, and that
//! what the handlers answer (every field) matches the schema the document
//! gives for it; CI checks it with a validator, drives a session through a
//! client generated from it, and lets a property-based tester loose on it.

mod schemas;

use serde_json::{json, Value};

use self::schemas::Schemas;
use super::answers::{Activated, Resolved};
use super::answers::{
    AgentList, ComponentAdded, ComponentList, SendAnswer, SessionList, SessionStarted, StepHistory,
    Stopped, TurnCancel,
};
use super::error::ErrorBody;
use super::messages::SendMessageBody;
use super::versions::{ActivateBody, RollbackBody};
use super::{StartSessionBody, MAX_HISTORY_PAGE, MAX_SESSION_PAGE};
use crate::catalog::AgentVersions;
use crate::session::{
    AgentMessagesPage, AgentSnapshot, ResolveInterruptRequest, MAX_IDEMPOTENCY_KEYS,
    MAX_IDEMPOTENCY_KEY_BYTES, MAX_MESSAGE_PAGE, MAX_TURN_WAIT, MAX_USER_MESSAGE_BYTES,
};

/// The answers every operation can give besides its own: a 400 for a path
/// or query the server cannot read, a 500, and a 503 when the store is down
/// or the API's connections are all taken.
const ALWAYS: [u16; 3] = [400, 500, 503];

fn error_responses(error: &Value, codes: &[u16]) -> Value {
    let mut responses = serde_json::Map::new();
    let mut all: Vec<u16> = codes.iter().chain(ALWAYS.iter()).copied().collect();
    all.sort_unstable();
    all.dedup();
    for code in &all {
        let description = match code {
            400 => "Bad input: the body, a query parameter or a header is invalid",
            401 => "No valid bearer token",
            404 => "No such agent or session (`not_found`), or no such interrupt on the session (`interrupt_not_found`)",
            409 => "Conflict: the session exists, is not running, or a Step holds a lock",
            413 => "Too large: the request body is over the server's limit (`payload_too_large`), or the user message over the session's cap (`message_too_large`); nothing was queued or started",
            415 => "The body is not sent as JSON (`unsupported_media_type`): send `content-type: application/json`",
            422 => "Refused: the Idempotency-Key was used before on this session with another text (`idempotency_key_reused`), or a version failed verification (`activation_refused`); nothing was done",
            500 => "A fault of the server (`internal`)",
            503 => "Not now (`store_unavailable`, `overloaded`): try again after `Retry-After` seconds",
            _ => "Error",
        };
        let mut response =
            json!({"description": description, "content": {"application/json": {"schema": error}}});
        if *code == 503 {
            response["headers"] = json!({"Retry-After": {"description": "Seconds to wait before trying again", "schema": {"type": "integer"}}});
        }
        responses.insert(code.to_string(), response);
    }
    Value::Object(responses)
}

/// `ok`'s answers and the error answers (of schema `error`) of `codes` and
/// [`ALWAYS`].
fn with_errors(error: &Value, mut ok: Value, codes: &[u16]) -> Value {
    if let (Some(ok), Value::Object(errors)) = (ok.as_object_mut(), error_responses(error, codes)) {
        ok.extend(errors);
    }
    ok
}

impl Schemas {
    /// A JSON request body of type `T`.
    fn json_body<T: schemars::JsonSchema>(&mut self) -> Value {
        json!({"required": true, "content": {"application/json": {"schema": self.body::<T>()}}})
    }

    /// A JSON answer of type `T`.
    fn json_ok<T: schemars::JsonSchema>(&mut self, description: &str) -> Value {
        json!({"description": description, "content": {"application/json": {"schema": self.answer::<T>()}}})
    }
}

/// The `X-Dexa-Actor` header of the activation log's writes.
fn actor_param() -> Value {
    json!({"name": "X-Dexa-Actor", "in": "header", "required": false,
        "description": "Who the log records (default `api`): 1 to 200 printable characters; another is a 400",
        "schema": {"type": "string", "minLength": 1, "maxLength": 200, "pattern": "^[\\x21-\\x7E]([\\x20-\\x7E]*[\\x21-\\x7E])?$"}})
}

fn session_param() -> Value {
    json!({"name": "session_id", "in": "path", "required": true, "schema": {"type": "string"}})
}

pub fn document() -> Value {
    let mut s = Schemas::new();
    let error = s.answer::<ErrorBody>();
    let mut document = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "dexa",
            "version": env!("CARGO_PKG_VERSION"),
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
            "description": "Durable agent sessions whose runner and tools are sandboxed WebAssembly components. Every /v1 route needs `Authorization: Bearer <token>`. When every connection the server keeps for the API is taken, any request but `GET /healthz` gets a 503 `overloaded` with `Retry-After`. `GET /healthz` is a liveness check; `GET /readyz` answers 200 only while the store answers (and takes this process's worker's claims), else a 503 `store_unavailable`."
        },
        "servers": [{"url": "/", "description": "The server that serves this document"}],
        "security": [{"bearer": []}],
        "paths": {
            "/v1/agents": {"get": {
                "operationId": "listAgents", "summary": "The agents this server runs",
                "responses": with_errors(&error, json!({"200": s.json_ok::<AgentList>("The agents")}), &[401])
            }},
            "/v1/agents/{agent}/sessions": {"post": {
                "operationId": "startSession", "summary": "Start a session; a non-blank message starts its first turn",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}}],
                "requestBody": s.json_body::<StartSessionBody>(),
                "responses": with_errors(&error, json!({"201": s.json_ok::<SessionStarted>("Started")}), &[400, 401, 404, 409, 413, 415])
            }},
            "/v1/sessions": {"get": {
                "operationId": "listSessions", "summary": "Sessions, newest first, paged by cursor",
                "parameters": [
                    {"name": "agent", "in": "query", "schema": {"type": "string"}},
                    {"name": "cursor", "in": "query", "description": "The `next_cursor` of the page before, as it was given; another is a 400 `invalid_cursor`", "schema": {"type": "string", "minLength": 1, "pattern": "^[A-Za-z0-9_-]+$"}},
                    {"name": "limit", "in": "query", "description": format!("How many sessions; clamped to 1..{MAX_SESSION_PAGE} (0 lists one, a larger one lists {MAX_SESSION_PAGE})"), "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX, "default": 100}}
                ],
                "responses": with_errors(&error, json!({"200": s.json_ok::<SessionList>("Sessions")}), &[400, 401, 404])
            }},
            "/v1/sessions/{session_id}": {"get": {
                "operationId": "getAgentSnapshot", "summary": "The session as a UI draws it (last 200 messages)",
                "parameters": [session_param()],
                "responses": with_errors(&error, json!({"200": s.json_ok::<AgentSnapshot>("The snapshot")}), &[401, 404])
            }},
            "/v1/sessions/{session_id}/messages": {
                "get": {
                    "operationId": "listAgentMessages", "summary": "Messages oldest first, paged",
                    "parameters": [
                        session_param(),
                        {"name": "after_sequence", "in": "query", "schema": {"type": "integer", "minimum": 0, "maximum": u64::MAX}},
                        {"name": "limit", "in": "query", "description": format!("How many messages; clamped to 1..{MAX_MESSAGE_PAGE}, as the spec says"), "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX, "default": 50}}
                    ],
                    "responses": with_errors(&error, json!({"200": s.json_ok::<AgentMessagesPage>("A page")}), &[400, 401, 404])
                },
                "post": {
                    "operationId": "sendUserMessage", "summary": "Queue a user message; it starts the next turn",
                    "description": format!(
                        "With an `Idempotency-Key` header the send acts at most once per key and session: \
                         a retry with the same key and text queues nothing and gets the first answer \
                         (202, with `\"replayed\": true`); the same key with another text is a 422. \
                         A session remembers a key for at least 24 hours, and at most its {MAX_IDEMPOTENCY_KEYS} newest keys. \
                         A text over {MAX_USER_MESSAGE_BYTES} bytes is a 413 and nothing is queued. \
                         With `?wait=SECONDS` (0 to {max_wait}) the answer waits for the turn the message starts: \
                         200 with the turn's new messages and usage when it completes (or its error when it fails), \
                         202 with the turn id when it waits for an approval or the wait runs out. \
                         A client that goes away does not cancel the turn; a replayed send waits for the first send's turn.",
                        max_wait = MAX_TURN_WAIT.as_secs()
                    ),
                    "parameters": [
                        session_param(),
                        {"name": "Idempotency-Key", "in": "header", "required": false,
                         "description": format!("1 to {MAX_IDEMPOTENCY_KEY_BYTES} printable ASCII characters, no space at either end; a bad key is a 400 `invalid_idempotency_key`"),
                         "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY_BYTES}},
                        {"name": "wait", "in": "query", "required": false,
                         "description": "Seconds to wait for the turn the message starts",
                         "schema": {"type": "number", "minimum": 0, "maximum": MAX_TURN_WAIT.as_secs()}}
                    ],
                    "requestBody": s.json_body::<SendMessageBody>(),
                    "responses": with_errors(&error, json!({
                        "200": s.json_ok::<SendAnswer>("With `wait`: the turn ended (`status` completed, failed or cancelled), or the session did first (`session_ended`, with its `session_status`)"),
                        "202": s.json_ok::<SendAnswer>("Queued (or, for a retried key, queued before); with `wait`, the turn waits for an approval or still runs")
                    }), &[400, 401, 404, 409, 413, 415, 422])
                }
            },
            "/v1/sessions/{session_id}/interrupts": {"post": {
                "operationId": "resolveInterrupt", "summary": "Approve or reject a pending tool call",
                "parameters": [session_param()],
                "requestBody": s.json_body::<ResolveInterruptRequest>(),
                "description": "`resolved` is false when the interrupt is no longer pending (answered before, or expired) or the session is not running; an interrupt the session never raised is a 404 `interrupt_not_found`.",
                "responses": with_errors(&error, json!({"200": s.json_ok::<Resolved>("Whether it was pending and is now resolved")}), &[400, 401, 404, 409, 413, 415])
            }},
            "/v1/sessions/{session_id}/turn/cancel": {"post": {
                "operationId": "cancelTurn", "summary": "Cancel the running turn",
                "description": "The turn's running guest calls are stopped on whichever worker runs them; its unfinished tool calls are recorded `cancelled` (a single-attempt write that had started, `outcome_unknown`); a note listing them goes into the history and `turn_cancelled` ends the turn. Queued messages stay queued and the session goes on. With `turn_id`, only that turn is cancelled: a cancel sent late (a retry, a stale page) leaves the next turn alone and answers `cancelled: false` with the `running_turn_id`.",
                "parameters": [session_param(),
                    {"name": "turn_id", "in": "query", "description": "Cancel only if this is the running turn (an empty one is a 400)", "schema": {"type": "string", "minLength": 1}}],
                "responses": with_errors(&error, json!({"200": s.json_ok::<TurnCancel>("Whether a turn was running and is being cancelled")}), &[400, 401, 404, 409])
            }},
            "/v1/sessions/{session_id}/stop": {"post": {
                "operationId": "stopSession", "summary": "Stop the session; its state stays readable",
                "parameters": [session_param()],
                "responses": with_errors(&error, json!({"200": s.json_ok::<Stopped>("Whether it was running")}), &[401, 404])
            }},
            "/v1/sessions/{session_id}/history": {"get": {
                "operationId": "getStepHistory", "summary": "Completed and failed Steps, oldest first, paged by cursor",
                "parameters": [session_param(),
                    {"name": "after", "in": "query", "description": "The `next_after` of the page before", "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX}},
                    {"name": "limit", "in": "query", "description": format!("How many entries; clamped to 1..{MAX_HISTORY_PAGE}"), "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX, "default": MAX_HISTORY_PAGE}}],
                "responses": with_errors(&error, json!({"200": s.json_ok::<StepHistory>("The Step history")}), &[400, 401, 404])
            }},
            "/v1/components": {
                "get": {
                    "operationId": "listComponents", "summary": "The component catalog: every version, by SHA-256",
                    "responses": with_errors(&error, json!({"200": s.json_ok::<ComponentList>("The versions")}), &[401])
                },
                "post": {
                    "operationId": "uploadComponent",
                    "summary": "Verify a runner or tool component (its world, compiled, pre-instantiated, list-tools) and add it; idempotent by digest",
                    "requestBody": {"required": true, "description": "The component's bytes, as they are; any content type", "content": {
                        "application/wasm": {"schema": {"type": "string", "format": "binary", "minLength": 1}},
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary", "minLength": 1}}}},
                    "responses": with_errors(&error, json!({
                        "201": s.json_ok::<ComponentAdded>("Added"),
                        "200": s.json_ok::<ComponentAdded>("Already in the catalog")
                    }), &[400, 401, 413, 422])
                }
            },
            "/v1/agents/{agent}/versions": {"get": {
                "operationId": "getAgentVersions", "summary": "The agent's activation log and what each role takes now",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}}],
                "responses": with_errors(&error, json!({"200": s.json_ok::<AgentVersions>("Versions")}), &[401, 404])
            }},
            "/v1/agents/{agent}/activations": {"post": {
                "operationId": "activateVersion",
                "summary": "Verify an uploaded version for a role and activate it for new turns (or a ramp); a refusal (422) changes nothing",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}},
                    actor_param()],
                "requestBody": s.json_body::<ActivateBody>(),
                "responses": with_errors(&error, json!({"201": s.json_ok::<Activated>("Activated")}), &[400, 401, 404, 413, 415, 422])
            }},
            "/v1/agents/{agent}/rollback": {"post": {
                "operationId": "rollBack",
                "summary": "Activate the version that was current before (or end a ramp)",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}},
                    actor_param()],
                "requestBody": s.json_body::<RollbackBody>(),
                "responses": with_errors(&error, json!({"201": s.json_ok::<Activated>("Activated")}), &[400, 401, 404, 409, 413, 415, 422])
            }},
            "/v1/sessions/{session_id}/events": {"get": {
                "operationId": "streamEvents",
                "summary": "Server-Sent Events: id is the event's sequence, event its type, data the AgentEvent; resume with Last-Event-ID",
                "description": "Once the session has ended (stopped, failed or completed) and every event is sent, a last event named `session_ended`, with the last event's id (0 when there was none) and data `SessionEnded`, ends the stream. A reconnect with `Last-Event-ID` to an ended session with nothing left to send is answered 204, which tells a browser's EventSource to stop reconnecting.",
                "parameters": [
                    session_param(),
                    {"name": "Last-Event-ID", "in": "header", "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX}},
                    {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX}}
                ],
                "responses": with_errors(&error, json!({
                    "200": {"description": "The event stream; it ends after `session_ended`, or when the store fails (reconnect with Last-Event-ID)", "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/EventStream"}}}},
                    "204": {"description": "A reconnect to an ended session with nothing left to send"}
                }), &[400, 401, 404])
            }}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}
        }
    });
    document["components"]["schemas"] = s.into_components();
    document
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema<'a>(document: &'a Value, name: &str) -> &'a Value {
        let schema = &document["components"]["schemas"][name];
        assert!(schema.is_object(), "no schema {name}");
        schema
    }

    fn required(schema: &Value) -> Vec<&str> {
        schema["required"]
            .as_array()
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default()
    }

    #[test]
    fn fields_always_sent_are_required_and_typed_by_their_rust_types() {
        let document = document();
        let snapshot = schema(&document, "AgentSnapshot");
        for field in ["agent", "state", "usage", "pending_interrupts", "messages"] {
            assert!(required(snapshot).contains(&field), "{field}");
        }
        assert_eq!(
            snapshot["properties"]["usage"]["$ref"],
            "#/components/schemas/AgentUsage"
        );
        assert_eq!(
            snapshot["properties"]["pending_interrupts"]["items"]["$ref"],
            "#/components/schemas/AgentInterrupt"
        );
        // Sent only during a turn: optional, and never null when sent.
        let state = schema(&document, "AgentState");
        assert!(!required(state).contains(&"runner_digest"));
        assert_eq!(state["properties"]["runner_digest"]["type"], "string");
        // A field that is always sent but may be null is required.
        assert!(required(state).contains(&"active_turn_id"));
        let codes = &schema(&document, "ErrorCode")["enum"];
        assert!(codes
            .as_array()
            .is_some_and(|c| c.contains(&json!("interrupt_not_found"))));
    }

    #[test]
    fn each_host_event_type_has_its_own_data_schema() {
        let document = document();
        let event = schema(&document, "AgentEvent");
        let variants = event["oneOf"].as_array().expect("oneOf");
        let types = crate::session::event_data::host_event_types();
        // One per host type, and the guest's own.
        assert_eq!(variants.len(), types.len() + 1);
        let started = schema(&document, "TurnStartedEvent");
        assert_eq!(started["properties"]["type"]["const"], "turn_started");
        assert_eq!(
            started["properties"]["data"]["$ref"],
            "#/components/schemas/TurnStartedData"
        );
        assert_eq!(
            required(schema(&document, "ToolCallFinishedData")),
            ["tool_call_id", "tool_name", "status"]
        );
        // Fields older versions did not store are sent, but not required.
        let turn_started = schema(&document, "TurnStartedData");
        assert_eq!(required(turn_started), ["sequence"]);
        assert!(turn_started["properties"]["message_id"].is_object());
    }

    #[test]
    fn no_schema_has_a_null_default() {
        fn walk(value: &Value, at: &str) {
            match value {
                Value::Object(map) => {
                    assert!(!map.get("default").is_some_and(Value::is_null), "{at}");
                    for (key, inner) in map {
                        walk(inner, &format!("{at}/{key}"));
                    }
                }
                Value::Array(items) => items.iter().for_each(|v| walk(v, at)),
                _ => {}
            }
        }
        walk(&document(), "");
    }
}
