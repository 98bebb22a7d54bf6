//! The OpenAPI 3.1 document served at `/openapi.json`. Tests check that every
//! operation it lists is routed and that every `$ref` resolves.

use serde_json::{json, Value};

use super::{MAX_HISTORY_PAGE, MAX_SESSION_ID, MAX_SESSION_PAGE};
use crate::session::{
    MAX_IDEMPOTENCY_KEYS, MAX_IDEMPOTENCY_KEY_BYTES, MAX_MESSAGE_PAGE, MAX_TURN_WAIT,
    MAX_USER_MESSAGE_BYTES,
};

fn error_responses(codes: &[u16]) -> Value {
    let mut responses = serde_json::Map::new();
    for code in codes {
        let description = match code {
            400 => "Bad input: the body, a query parameter or a header is invalid",
            401 => "No valid bearer token",
            404 => "No such agent or session (`not_found`), or no such interrupt on the session (`interrupt_not_found`)",
            409 => "Conflict: the session exists, is not running, or a Step holds a lock",
            413 => "Too large: the request body is over the server's limit (`payload_too_large`), or the user message over the session's cap (`message_too_large`); nothing was queued or started",
            415 => "The body is not sent as JSON (`unsupported_media_type`): send `content-type: application/json`",
            422 => "The Idempotency-Key was used before on this session with another text (`idempotency_key_reused`); nothing was queued",
            _ => "Error",
        };
        responses.insert(
            code.to_string(),
            json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}),
        );
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

fn session_param() -> Value {
    json!({"name": "session_id", "in": "path", "required": true, "schema": {"type": "string"}})
}

pub fn document() -> Value {
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "dexa",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Durable agent sessions whose runner and tools are sandboxed WebAssembly components. Every /v1 route needs `Authorization: Bearer <token>`. When every connection the server keeps for the API is taken, any request but `GET /healthz` gets a 503 `overloaded` with `Retry-After`. `GET /healthz` is a liveness check; `GET /readyz` answers 200 only while the store answers (and takes this process's worker's claims), else a 503 `store_unavailable`."
        },
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
                    {"name": "cursor", "in": "query", "description": "The `next_cursor` of the page before, as it was given; another is a 400 `invalid_cursor`", "schema": {"type": "string"}},
                    {"name": "limit", "in": "query", "description": format!("How many sessions; clamped to 1..{MAX_SESSION_PAGE} (0 lists one, a larger one lists {MAX_SESSION_PAGE})"), "schema": {"type": "integer", "default": 100}}
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
                        {"name": "after_sequence", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                        {"name": "limit", "in": "query", "description": format!("How many messages; clamped to 1..{MAX_MESSAGE_PAGE}, as the spec says"), "schema": {"type": "integer", "default": 50}}
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
                "responses": with_errors(json!({"200": json_ok("Whether a turn was running and is being cancelled", "TurnCancel")}), &[401, 404, 409])
            }},
            "/v1/sessions/{session_id}/stop": {"post": {
                "operationId": "stopSession", "summary": "Stop the session; its state stays readable",
                "parameters": [session_param()],
                "responses": with_errors(json!({"200": json_ok("Whether it was running", "Stopped")}), &[401, 404])
            }},
            "/v1/sessions/{session_id}/history": {"get": {
                "operationId": "getStepHistory", "summary": "Completed and failed Steps, oldest first, paged by cursor",
                "parameters": [session_param(),
                    {"name": "after", "in": "query", "description": "The `next_after` of the page before", "schema": {"type": "integer"}},
                    {"name": "limit", "in": "query", "description": format!("How many entries; clamped to 1..{MAX_HISTORY_PAGE}"), "schema": {"type": "integer", "default": MAX_HISTORY_PAGE}}],
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
                    "requestBody": {"required": true, "content": {"application/wasm": {"schema": {"type": "string", "format": "binary"}}}},
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
                    {"name": "X-Dexa-Actor", "in": "header", "required": false, "description": "Who the log records (default `api`)", "schema": {"type": "string", "maxLength": 200}}],
                "requestBody": json_body("Activate"),
                "responses": with_errors(json!({"201": json_ok("Activated", "Activated")}), &[400, 401, 404, 413, 415, 422])
            }},
            "/v1/agents/{agent}/rollback": {"post": {
                "operationId": "rollBack",
                "summary": "Activate the version that was current before (or end a ramp)",
                "parameters": [{"name": "agent", "in": "path", "required": true, "schema": {"type": "string"}},
                    {"name": "X-Dexa-Actor", "in": "header", "required": false, "schema": {"type": "string", "maxLength": 200}}],
                "requestBody": json_body("Rollback"),
                "responses": with_errors(json!({"201": json_ok("Activated", "Activated")}), &[400, 401, 404, 409, 413, 415, 422])
            }},
            "/v1/sessions/{session_id}/events": {"get": {
                "operationId": "streamEvents",
                "summary": "Server-Sent Events: id is the event's sequence, event its type, data the AgentEvent; resume with Last-Event-ID",
                "description": "Once the session has ended (stopped, failed or completed) and every event is sent, a last event named `session_ended`, with the last event's id (0 when there was none) and data `SessionEnded`, ends the stream. A reconnect with `Last-Event-ID` to an ended session with nothing left to send is answered 204, which tells a browser's EventSource to stop reconnecting.",
                "parameters": [
                    session_param(),
                    {"name": "Last-Event-ID", "in": "header", "schema": {"type": "integer"}},
                    {"name": "after", "in": "query", "schema": {"type": "integer"}}
                ],
                "responses": with_errors(json!({
                    "200": {"description": "The event stream; it ends after `session_ended`, or when the store fails (reconnect with Last-Event-ID)", "content": {"text/event-stream": {"schema": {"$ref": "#/components/schemas/AgentEvent"}}}},
                    "204": {"description": "A reconnect to an ended session with nothing left to send"}
                }), &[400, 401, 404])
            }}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": schemas()
        }
    })
}

fn schemas() -> Value {
    json!({
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
            "code": {"type": "string", "enum": ["bad_request", "unauthorized", "not_found", "already_exists", "conflict", "not_running", "busy", "method_not_allowed", "store_unavailable", "internal", "payload_too_large", "unsupported_media_type", "message_too_large", "invalid_idempotency_key", "idempotency_key_reused", "activation_refused", "nothing_to_roll_back", "activation_log_moved", "interrupt_not_found", "invalid_cursor"]},
            "message": {"type": "string"}}}}},
        "AgentList": {"type": "object", "properties": {"agents": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "runner": {"type": "string"}, "tool_components": {"type": "array", "items": {"type": "string"}}, "model": {"type": ["string", "null"]}}}}}},
        "StartSession": {"type": "object", "properties": {"session_id": {"type": "string", "minLength": 1, "maxLength": MAX_SESSION_ID, "pattern": "\\S",
            "description": format!("Generated when absent. 1 to {MAX_SESSION_ID} bytes of UTF-8, not blank, no control characters; another is a 400 (null too)")}, "message": {"type": "string", "description": format!("At most {MAX_USER_MESSAGE_BYTES} bytes of UTF-8")}}, "additionalProperties": false},
        "SessionStarted": {"type": "object", "properties": {"session_id": {"type": "string"}, "agent": {"type": "string"}}},
        "SessionList": {"type": "object", "required": ["sessions", "next_cursor"], "properties": {
            "next_cursor": {"type": ["string", "null"], "description": "Pass as `cursor` for the next page; null on the last page"},
            "sessions": {"type": "array", "items": {"type": "object", "required": ["session_id", "agent", "status", "created_at", "updated_at", "error"], "properties": {
            "session_id": {"type": "string"}, "agent": {"type": "string"}, "status": {"$ref": "#/components/schemas/FlowStatus"},
            "created_at": {"type": "integer"}, "updated_at": {"type": "integer"}, "error": {"type": ["string", "null"]}}}}}},
        "FlowStatus": {"type": "string", "enum": ["running", "completed", "failed", "stopped"]},
        "SendMessage": {"type": "object", "required": ["text"], "properties": {
            "text": {"type": "string", "minLength": 1, "pattern": "\\S", "description": format!("At most {MAX_USER_MESSAGE_BYTES} bytes of UTF-8; a blank text is a 400 and nothing is queued")},
            "interrupt": {"type": "boolean", "default": false, "description": "Steer: cancel the running turn (as /turn/cancel does) and start the next turn with this message, ahead of the queue; with no turn running it is queued as usual"}},
            "additionalProperties": false},
        "TurnCancel": {"type": "object", "required": ["cancelled"], "properties": {
            "cancelled": {"type": "boolean", "description": "False when no turn was running"},
            "turn_id": {"type": "string", "description": "The cancelled turn"}}},
        "Queued": {"type": "object", "required": ["queued"], "properties": {
            "queued": {"type": "boolean"},
            "idempotency_key": {"type": "string", "description": "The request's Idempotency-Key; only when it sent one"},
            "replayed": {"type": "boolean", "description": "Only with an Idempotency-Key: true when a message with this key was queued before and nothing was queued now"},
            "interrupted": {"type": ["string", "null"], "description": "Only with `interrupt`: the turn it cancelled, null when none ran"},
            "message_id": {"type": ["string", "null"], "description": "The queued message's id (a replay's is the first send's); the turn_started event of its turn carries it"},
            "status": {"type": "string", "enum": ["completed", "failed", "cancelled", "waiting_for_approval", "running"], "description": "Only with `wait`: how the wait ended"},
            "turn_id": {"type": ["string", "null"], "description": "Only with `wait`: the message's turn; null while it is still queued"},
            "messages": {"type": "array", "items": {"$ref": "#/components/schemas/AgentMessage"}, "description": "Only when completed: the messages the turn added after the user's"},
            "usage": {"type": "object", "description": "Only when completed: what the turn's model calls used"},
            "error": {"type": "string", "description": "Only when failed"},
            "interrupts": {"type": "array", "items": {"type": "object"}, "description": "Only when waiting_for_approval: the turn's pending approvals"}}},
        "ResolveInterrupt": {"type": "object", "required": ["interrupt_id", "approved"], "properties": {
            "interrupt_id": {"type": "string", "description": "<turn_id>/<tool_call_id>"}, "approved": {"type": "boolean"}, "rejection_message": {"type": ["string", "null"]}}},
        "Resolved": {"type": "object", "properties": {"resolved": {"type": "boolean"}}},
        "Stopped": {"type": "object", "properties": {"stopped": {"type": "boolean"}}},
        "AgentMessage": {"type": "object", "properties": {
            "sequence": {"type": "integer"}, "turn_id": {"type": "string"}, "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "framework_item": {"type": "string"}, "text": {"type": ["string", "null"]}}},
        "AgentMessagesPage": {"type": "object", "properties": {
            "messages": {"type": "array", "items": {"$ref": "#/components/schemas/AgentMessage"}}, "next_after_sequence": {"type": ["integer", "null"]}}},
        "AgentToolCall": {"type": "object", "properties": {
            "tool_call_id": {"type": "string"}, "turn_id": {"type": "string"}, "tool_name": {"type": "string"}, "arguments": {"type": "string"},
            "effect": {"type": "string", "enum": ["read", "idempotent_write", "non_idempotent_write", "unclassified"]},
            "requires_approval": {"type": "boolean"},
            "status": {"type": "string", "enum": ["pending", "approved", "rejected", "succeeded", "failed", "outcome_unknown", "cancelled"]},
            "output": {"type": ["string", "null"]}, "error": {"type": ["string", "null"]}, "rejection_message": {"type": ["string", "null"]}, "deferral_order": {"type": "integer"},
            "component": {"type": "string", "description": "The tool component that runs it; absent when the runner does"},
            "digest": {"type": "string", "description": "The version it is pinned to (decided at deferral)"}}},
        "AgentSnapshot": {"type": "object", "properties": {
            "session_id": {"type": "string"}, "agent": {"type": "string"}, "flow_status": {"$ref": "#/components/schemas/FlowStatus"},
            "state": {"type": ["object", "null"]},
            "messages": {"type": "array", "items": {"$ref": "#/components/schemas/AgentMessage"}},
            "pending_interrupts": {"type": "array", "items": {"type": "object"}},
            "tool_calls": {"type": "array", "items": {"$ref": "#/components/schemas/AgentToolCall"}},
            "usage": {"type": "object"}, "queued_message_count": {"type": "integer"}}},
        "StepHistory": {"type": "object", "required": ["steps", "next_after"], "properties": {
            "next_after": {"type": ["integer", "null"], "description": "Pass as `after` for the next page; null on the last page"},
            "steps": {"type": "array", "items": {"type": "object", "properties": {
            "event_type": {"type": "string", "enum": ["execute_completed", "attempt_failed", "execute_failed", "redelivered"]},
            "step_type": {"type": "string"}, "step_execution_id": {"type": "string"}, "final_attempt": {"type": "integer"},
            "at": {"type": "integer", "description": "when the reported attempt ended (ms)"},
            "started_at": {"type": ["integer", "null"], "description": "when the reported attempt started (ms)"},
            "detail": {"type": ["string", "null"]},
            "component": {"type": "string", "pattern": "^[0-9a-f]{64}$", "description": "the SHA-256 (hex) of the component version (runner or tool) the reported attempt ran; absent when the Step ran none"}}}}}},
        "ComponentRecord": {"type": "object", "required": ["digest", "world", "wit_package", "tools", "size", "added_at", "added_by"], "properties": {
            "digest": {"type": "string", "description": "SHA-256 of the bytes, hex"}, "world": {"type": "string", "enum": ["runner", "tool"]},
            "wit_package": {"type": "string"}, "size": {"type": "integer"}, "added_at": {"type": "integer"}, "added_by": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, "effect": {"type": ["string", "null"]}}}}}},
        "ComponentList": {"type": "object", "properties": {"components": {"type": "array", "items": {"$ref": "#/components/schemas/ComponentRecord"}}}},
        "ComponentAdded": {"type": "object", "properties": {"component": {"$ref": "#/components/schemas/ComponentRecord"}, "added": {"type": "boolean"}}},
        "Activation": {"type": "object", "properties": {
            "seq": {"type": "integer"}, "agent": {"type": "string"}, "role": {"type": "string"}, "digest": {"type": "string"},
            "mode": {"type": "string", "enum": ["current", "ramp"]}, "percent": {"type": "integer", "description": "Only for a ramp"},
            "upgrade_in_flight": {"type": "boolean"}, "actor": {"type": "string"}, "reason": {"type": "string"}, "at": {"type": "integer"}}},
        "Activated": {"type": "object", "properties": {"activation": {"$ref": "#/components/schemas/Activation"}}},
        "AgentVersions": {"type": "object", "properties": {
            "agent": {"type": "string"},
            "roles": {"type": "object", "additionalProperties": {"type": "object", "properties": {
                "current": {"type": ["string", "null"]}, "ramp": {"type": ["object", "null"]}, "upgrade_in_flight": {"type": "boolean"},
                "moving_off": {"type": "array", "items": {"type": "string"}, "description": "Versions an upgrade in flight moves open turns off, at their next RunModel"}}}},
            "log": {"type": "array", "items": {"$ref": "#/components/schemas/Activation"}}}},
        "Activate": {"type": "object", "required": ["role", "digest"], "additionalProperties": false, "properties": {
            "role": {"type": "string", "description": "`runner`, or a tool component's name in dexa.toml"},
            "digest": {"type": "string", "description": "64 hex digits of an uploaded version"},
            "ramp": {"type": "integer", "minimum": 1, "maximum": 99, "description": "Percent of sessions (stable by session id); absent: every new turn"},
            "upgrade_in_flight": {"type": "boolean", "description": "Move turns pinned to another runner at their next RunModel"},
            "reason": {"type": "string"}}},
        "Rollback": {"type": "object", "additionalProperties": false, "properties": {
            "role": {"type": "string", "description": "`runner` (default) or a tool component's name"},
            "upgrade_in_flight": {"type": "boolean"}, "reason": {"type": "string"}}},
        "SessionEnded": {"type": "object", "required": ["session_id", "status", "error"], "properties": {
            "session_id": {"type": "string"}, "status": {"$ref": "#/components/schemas/FlowStatus"}, "error": {"type": ["string", "null"]}}},
        "AgentEvent": {"type": "object", "properties": {
            "type": {"type": "string"}, "turn_id": {"type": "string"}, "step_execution_id": {"type": "string"}, "attempt": {"type": "integer"}, "data": {"type": "object"}}}
    })
}
