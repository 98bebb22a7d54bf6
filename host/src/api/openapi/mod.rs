//! The OpenAPI 3.1 document served at `/openapi.json`: the operations here,
//! the schemas in [`schemas`]. Tests check that every operation it lists is
//! routed, that every `$ref` resolves, and that what the handlers answer
//! (every field) matches the schema the document gives for it; CI checks it
//! with a validator and drives a session through a client generated from it.

mod schemas;

use serde_json::{json, Value};

use super::{MAX_HISTORY_PAGE, MAX_SESSION_PAGE};
use crate::session::{
    MAX_IDEMPOTENCY_KEYS, MAX_IDEMPOTENCY_KEY_BYTES, MAX_MESSAGE_PAGE, MAX_TURN_WAIT,
    MAX_USER_MESSAGE_BYTES,
};

/// The answers every operation can give besides its own: a 400 for a path
/// or query the server cannot read, a 500, and a 503 when the store is down
/// or the API's connections are all taken.
const ALWAYS: [u16; 3] = [400, 500, 503];

fn error_responses(codes: &[u16]) -> Value {
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
        let mut response = json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}});
        if *code == 503 {
            response["headers"] = json!({"Retry-After": {"description": "Seconds to wait before trying again", "schema": {"type": "integer"}}});
        }
        responses.insert(code.to_string(), response);
    }
    Value::Object(responses)
}

fn with_errors(mut ok: Value, codes: &[u16]) -> Value {
    if let (Some(ok), Value::Object(errors)) = (ok.as_object_mut(), error_responses(codes)) {
        ok.extend(errors);
    }
    ok
}

fn json_body(schema: &str) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
}

fn json_ok(description: &str, schema: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
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
    json!({
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
                "responses": with_errors(json!({"200": json_ok("The agents", "AgentList")}), &[401])
            }},
            "/v1/agents/{agent}/sessions": {"post": {
                "operationId": "startSession", "summary": "Start a session; a non-blank message starts its first turn",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}}],
                "requestBody": json_body("StartSession"),
                "responses": with_errors(json!({"201": json_ok("Started", "SessionStarted")}), &[400, 401, 404, 409, 413, 415])
            }},
            "/v1/sessions": {"get": {
                "operationId": "listSessions", "summary": "Sessions, newest first, paged by cursor",
                "parameters": [
                    {"name": "agent", "in": "query", "schema": {"type": "string"}},
                    {"name": "cursor", "in": "query", "description": "The `next_cursor` of the page before, as it was given; another is a 400 `invalid_cursor`", "schema": {"type": "string", "minLength": 1, "pattern": "^[A-Za-z0-9_-]+$"}},
                    {"name": "limit", "in": "query", "description": format!("How many sessions; clamped to 1..{MAX_SESSION_PAGE} (0 lists one, a larger one lists {MAX_SESSION_PAGE})"), "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX, "default": 100}}
                ],
                "responses": with_errors(json!({"200": json_ok("Sessions", "SessionList")}), &[400, 401, 404])
            }},
            "/v1/sessions/{session_id}": {"get": {
                "operationId": "getAgentSnapshot", "summary": "The session as a UI draws it (last 200 messages)",
                "parameters": [session_param()],
                "responses": with_errors(json!({"200": json_ok("The snapshot", "AgentSnapshot")}), &[401, 404])
            }},
            "/v1/sessions/{session_id}/messages": {
                "get": {
                    "operationId": "listAgentMessages", "summary": "Messages oldest first, paged",
                    "parameters": [
                        session_param(),
                        {"name": "after_sequence", "in": "query", "schema": {"type": "integer", "minimum": 0, "maximum": u64::MAX}},
                        {"name": "limit", "in": "query", "description": format!("How many messages; clamped to 1..{MAX_MESSAGE_PAGE}, as the spec says"), "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX, "default": 50}}
                    ],
                    "responses": with_errors(json!({"200": json_ok("A page", "AgentMessagesPage")}), &[400, 401, 404])
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
                    "requestBody": json_body("SendMessage"),
                    "responses": with_errors(json!({
                        "200": json_ok("With `wait`: the turn ended (`status` completed, failed or cancelled)", "Queued"),
                        "202": json_ok("Queued (or, for a retried key, queued before); with `wait`, the turn waits for an approval or still runs", "Queued")
                    }), &[400, 401, 404, 409, 413, 415, 422])
                }
            },
            "/v1/sessions/{session_id}/interrupts": {"post": {
                "operationId": "resolveInterrupt", "summary": "Approve or reject a pending tool call",
                "parameters": [session_param()],
                "requestBody": json_body("ResolveInterrupt"),
                "description": "`resolved` is false when the interrupt is no longer pending (answered before, or expired) or the session is not running; an interrupt the session never raised is a 404 `interrupt_not_found`.",
                "responses": with_errors(json!({"200": json_ok("Whether it was pending and is now resolved", "Resolved")}), &[400, 401, 404, 409, 413, 415])
            }},
            "/v1/sessions/{session_id}/turn/cancel": {"post": {
                "operationId": "cancelTurn", "summary": "Cancel the running turn",
                "description": "The turn's running guest calls are stopped on whichever worker runs them; its unfinished tool calls are recorded `cancelled` (a single-attempt write that had started, `outcome_unknown`); a note listing them goes into the history and `turn_cancelled` ends the turn. Queued messages stay queued and the session goes on.",
                "parameters": [session_param()],
                "responses": with_errors(json!({"200": json_ok("Whether a turn was running and is being cancelled", "TurnCancel")}), &[400, 401, 404, 409])
            }},
            "/v1/sessions/{session_id}/stop": {"post": {
                "operationId": "stopSession", "summary": "Stop the session; its state stays readable",
                "parameters": [session_param()],
                "responses": with_errors(json!({"200": json_ok("Whether it was running", "Stopped")}), &[401, 404])
            }},
            "/v1/sessions/{session_id}/history": {"get": {
                "operationId": "getStepHistory", "summary": "Completed and failed Steps, oldest first, paged by cursor",
                "parameters": [session_param(),
                    {"name": "after", "in": "query", "description": "The `next_after` of the page before", "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX}},
                    {"name": "limit", "in": "query", "description": format!("How many entries; clamped to 1..{MAX_HISTORY_PAGE}"), "schema": {"type": "integer", "minimum": i64::MIN, "maximum": i64::MAX, "default": MAX_HISTORY_PAGE}}],
                "responses": with_errors(json!({"200": json_ok("The Step history", "StepHistory")}), &[400, 401, 404])
            }},
            "/v1/components": {
                "get": {
                    "operationId": "listComponents", "summary": "The component catalog: every version, by SHA-256",
                    "responses": with_errors(json!({"200": json_ok("The versions", "ComponentList")}), &[401])
                },
                "post": {
                    "operationId": "uploadComponent",
                    "summary": "Verify a runner or tool component (its world, compiled, pre-instantiated, list-tools) and add it; idempotent by digest",
                    "requestBody": {"required": true, "description": "The component's bytes, as they are; any content type", "content": {
                        "application/wasm": {"schema": {"type": "string", "format": "binary", "minLength": 1}},
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary", "minLength": 1}}}},
                    "responses": with_errors(json!({
                        "201": json_ok("Added", "ComponentAdded"),
                        "200": json_ok("Already in the catalog", "ComponentAdded")
                    }), &[400, 401, 413, 422])
                }
            },
            "/v1/agents/{agent}/versions": {"get": {
                "operationId": "getAgentVersions", "summary": "The agent's activation log and what each role takes now",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}}],
                "responses": with_errors(json!({"200": json_ok("Versions", "AgentVersions")}), &[401, 404])
            }},
            "/v1/agents/{agent}/activations": {"post": {
                "operationId": "activateVersion",
                "summary": "Verify an uploaded version for a role and activate it for new turns (or a ramp); a refusal (422) changes nothing",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}},
                    actor_param()],
                "requestBody": json_body("Activate"),
                "responses": with_errors(json!({"201": json_ok("Activated", "Activated")}), &[400, 401, 404, 413, 415, 422])
            }},
            "/v1/agents/{agent}/rollback": {"post": {
                "operationId": "rollBack",
                "summary": "Activate the version that was current before (or end a ramp)",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}},
                    actor_param()],
                "requestBody": json_body("Rollback"),
                "responses": with_errors(json!({"201": json_ok("Activated", "Activated")}), &[400, 401, 404, 409, 413, 415, 422])
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
                "responses": with_errors(json!({
                    "200": {"description": "The event stream; it ends after `session_ended`, or when the store fails (reconnect with Last-Event-ID)", "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/EventStream"}}}},
                    "204": {"description": "A reconnect to an ended session with nothing left to send"}
                }), &[400, 401, 404])
            }}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas::schemas()
        }
    })
}
