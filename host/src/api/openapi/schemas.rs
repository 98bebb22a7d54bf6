//! The schemas of the OpenAPI document: every request body and answer.
//! A field listed in `required` is in every answer; the others are present
//! only when their description says. A test validates what the handlers
//! answer against these, with every object closed to fields not listed here.

use serde_json::{json, Value};

use super::super::MAX_SESSION_ID;
use crate::session::{event_type, MAX_USER_MESSAGE_BYTES};

/// A `$ref` to schema `name`.
fn r(name: &str) -> Value {
    json!({"$ref": format!("#/components/schemas/{name}")})
}

/// The host's own event types (a guest's own events add others).
fn host_event_types() -> Vec<&'static str> {
    vec![
        event_type::TURN_STARTED,
        event_type::TURN_COMPLETED,
        event_type::TURN_FAILED,
        event_type::TURN_CANCEL_REQUESTED,
        event_type::TURN_CANCELLED,
        event_type::TEXT_DELTA,
        event_type::REASONING_DELTA,
        event_type::TOOL_CALL_STARTED,
        event_type::TOOL_CALL_FINISHED,
        event_type::TOOL_CALL_DEFERRED,
        event_type::INTERRUPT_RAISED,
        event_type::INTERRUPT_RESOLVED,
        event_type::USAGE_RECORDED,
        event_type::VERSION_CHANGED,
        event_type::HISTORY_COMPACTED,
        event_type::GUEST_LOG,
    ]
}

/// Every error code an answer may carry.
pub(super) const ERROR_CODES: [&str; 22] = [
    "bad_request",
    "invalid_request",
    "invalid_cursor",
    "invalid_idempotency_key",
    "unauthorized",
    "not_found",
    "interrupt_not_found",
    "method_not_allowed",
    "already_exists",
    "conflict",
    "not_running",
    "busy",
    "nothing_to_roll_back",
    "activation_log_moved",
    "payload_too_large",
    "message_too_large",
    "unsupported_media_type",
    "idempotency_key_reused",
    "activation_refused",
    "internal",
    "store_unavailable",
    "overloaded",
];

pub(super) fn schemas() -> Value {
    let mut schemas = serde_json::Map::new();
    for part in [requests(), sessions(), history_and_events(), catalog()] {
        if let Value::Object(part) = part {
            schemas.extend(part);
        }
    }
    Value::Object(schemas)
}

/// Request bodies.
fn requests() -> Value {
    json!({
        "StartSession": {"type": "object", "additionalProperties": false, "properties": {
            "session_id": {"type": "string", "minLength": 1, "maxLength": MAX_SESSION_ID,
                "pattern": "^[^\\u0000-\\u001F\\u007F-\\u009F]*[^\\s\\u0000-\\u001F\\u007F-\\u009F][^\\u0000-\\u001F\\u007F-\\u009F]*$",
                "description": format!("Generated when absent. 1 to {MAX_SESSION_ID} characters, not blank, no control characters; another (or null) is a 400")},
            "message": {"type": "string", "description": format!("At most {MAX_USER_MESSAGE_BYTES} bytes of UTF-8; blank (the default) starts no turn")}}},
        "SendMessage": {"type": "object", "required": ["text"], "additionalProperties": false, "properties": {
            "text": {"type": "string", "minLength": 1, "pattern": "\\S", "description": format!("At most {MAX_USER_MESSAGE_BYTES} bytes of UTF-8; a blank text is a 400 and nothing is queued")},
            "interrupt": {"type": "boolean", "default": false, "description": "Steer: cancel the running turn (as /turn/cancel does) and start the next turn with this message, ahead of the queue; with no turn running it is queued as usual"}}},
        "ResolveInterrupt": {"type": "object", "required": ["interrupt_id", "approved"], "additionalProperties": false, "properties": {
            "interrupt_id": {"type": "string", "description": "<turn_id>/<tool_call_id>, as `pending_interrupts` gives it"},
            "approved": {"type": "boolean"},
            "rejection_message": {"type": ["string", "null"], "description": "What the model reads for a rejection; ignored for an approval"}}},
        "Activate": {"type": "object", "required": ["role", "digest"], "additionalProperties": false, "properties": {
            "role": {"type": "string", "minLength": 1, "description": "`runner`, or a tool component's name in dexa.toml"},
            "digest": {"type": "string", "pattern": "^[0-9a-fA-F]{64}$", "description": "64 hex digits of an uploaded version"},
            "ramp": {"type": "integer", "minimum": 1, "maximum": 99, "description": "Percent of sessions (stable by session id); absent: every new turn"},
            "upgrade_in_flight": {"type": "boolean", "default": false, "description": "Move turns pinned to another runner at their next RunModel"},
            "reason": {"type": "string", "default": ""}}},
        "Rollback": {"type": "object", "additionalProperties": false, "properties": {
            "role": {"type": "string", "minLength": 1, "description": "`runner` (default) or a tool component's name"},
            "upgrade_in_flight": {"type": "boolean", "default": false}, "reason": {"type": "string", "default": ""}}},
    })
}

/// Agents, sessions, messages and the answers of the session RPCs.
fn sessions() -> Value {
    json!({
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["code", "message"], "properties": {
            "code": {"type": "string", "enum": ERROR_CODES},
            "message": {"type": "string"}}}}},
        "AgentList": {"type": "object", "required": ["agents"], "properties": {"agents": {"type": "array", "items": {
            "type": "object", "required": ["name", "runner", "tool_components", "model"], "properties": {
            "name": {"type": "string"}, "runner": {"type": "string"},
            "tool_components": {"type": "array", "items": {"type": "string"}},
            "model": {"type": ["string", "null"]}}}}}},
        "SessionStarted": {"type": "object", "required": ["session_id", "agent"], "properties": {
            "session_id": {"type": "string"}, "agent": {"type": "string"}}},
        "SessionList": {"type": "object", "required": ["sessions", "next_cursor"], "properties": {
            "next_cursor": {"type": ["string", "null"], "description": "Pass as `cursor` for the next page; null on the last page"},
            "sessions": {"type": "array", "items": r("SessionSummary")}}},
        "SessionSummary": {"type": "object", "required": ["session_id", "agent", "status", "created_at", "updated_at", "error"], "properties": {
            "session_id": {"type": "string"}, "agent": {"type": "string"}, "status": r("FlowStatus"),
            "created_at": {"type": "integer", "description": "ms since the epoch, on the store's clock"},
            "updated_at": {"type": "integer"}, "error": {"type": ["string", "null"]}}},
        "FlowStatus": {"type": "string", "enum": ["running", "completed", "failed", "stopped"]},
        "SessionStatus": {"type": "string", "enum": ["waiting_for_user_message", "running_model", "running_tools"]},
        "AgentState": {"type": "object", "required": ["status", "turn_count", "active_turn_id", "message_count", "last_turn_error"], "properties": {
            "status": r("SessionStatus"),
            "turn_count": {"type": "integer", "minimum": 0, "description": "Turns started so far; the active turn is `turn-<turn_count>`"},
            "active_turn_id": {"type": ["string", "null"]},
            "message_count": {"type": "integer", "minimum": 0},
            "last_turn_error": {"type": ["string", "null"], "description": "Why the last failed turn failed; cleared when a later turn completes"},
            "runner_digest": {"type": "string", "description": "Only during a turn: the runner version it is pinned to"},
            "turn_trace": r("TurnTrace")}},
        "TurnTrace": {"type": "object", "description": "Only during a turn: its W3C trace", "required": ["trace_id", "span_id", "sampled", "started_at_ms"], "properties": {
            "trace_id": {"type": "string"}, "span_id": {"type": "string"}, "parent_span_id": {"type": "string"},
            "sampled": {"type": "boolean"}, "started_at_ms": {"type": "integer"}}},
        "AgentUsage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens", "model_calls"], "properties": {
            "input_tokens": {"type": "integer", "minimum": 0}, "output_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 0}, "model_calls": {"type": "integer", "minimum": 0}}},
        "AgentInterrupt": {"type": "object", "required": ["interrupt_id", "turn_id", "tool_call_id", "tool_name", "arguments", "deadline"], "properties": {
            "interrupt_id": {"type": "string"}, "turn_id": {"type": "string"}, "tool_call_id": {"type": "string"},
            "tool_name": {"type": "string"}, "arguments": {"type": "string", "description": "The model's JSON text"},
            "deadline": {"type": ["integer", "null"], "description": "When it expires (ms, store clock); null waits forever"}}},
        "AgentMessage": {"type": "object", "required": ["sequence", "turn_id", "role", "framework_item", "text"], "properties": {
            "sequence": {"type": "integer", "minimum": 1}, "turn_id": {"type": "string"},
            "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
            "framework_item": {"type": "string", "description": "The runner's own item, opaque to the host"},
            "text": {"type": ["string", "null"]}}},
        "AgentMessagesPage": {"type": "object", "required": ["messages", "next_after_sequence"], "properties": {
            "messages": {"type": "array", "items": r("AgentMessage")},
            "next_after_sequence": {"type": ["integer", "null"], "description": "Pass as `after_sequence` for the next page; null on the last page"}}},
        "AgentToolCall": {"type": "object", "required": ["tool_call_id", "turn_id", "tool_name", "arguments", "effect", "requires_approval", "status", "output", "error", "rejection_message", "deferral_order"], "properties": {
            "tool_call_id": {"type": "string"}, "turn_id": {"type": "string"}, "tool_name": {"type": "string"}, "arguments": {"type": "string"},
            "effect": {"type": "string", "enum": ["read", "idempotent_write", "non_idempotent_write", "unclassified"]},
            "requires_approval": {"type": "boolean"},
            "status": {"type": "string", "enum": ["pending", "approved", "rejected", "succeeded", "failed", "outcome_unknown", "cancelled"]},
            "output": {"type": ["string", "null"]}, "error": {"type": ["string", "null"]}, "rejection_message": {"type": ["string", "null"]},
            "deferral_order": {"type": "integer", "minimum": 0},
            "output_limit": {"type": "integer", "description": "Only when the runner capped the output: bytes of it the model reads"},
            "component": {"type": "string", "description": "The tool component that runs it; absent when the runner does"},
            "digest": {"type": "string", "description": "The version it is pinned to (decided at deferral)"}}},
        "AgentSnapshot": {"type": "object", "required": ["session_id", "agent", "flow_status", "state", "messages", "pending_interrupts", "tool_calls", "usage", "queued_message_count"], "properties": {
            "session_id": {"type": "string"}, "agent": {"type": "string"}, "flow_status": r("FlowStatus"),
            "state": {"oneOf": [r("AgentState"), {"type": "null"}], "description": "Null until the session's first Step commits"},
            "messages": {"type": "array", "items": r("AgentMessage"), "description": "The last 200, oldest first"},
            "pending_interrupts": {"type": "array", "items": r("AgentInterrupt")},
            "tool_calls": {"type": "array", "items": r("AgentToolCall"), "description": "The active turn's, in deferral order"},
            "usage": r("AgentUsage"), "queued_message_count": {"type": "integer", "minimum": 0}}},
        "Queued": {"type": "object", "required": ["queued", "message_id"], "properties": {
            "queued": {"type": "boolean"},
            "message_id": {"type": ["string", "null"], "description": "The queued message's id (a replay's is the first send's); the turn_started event of its turn carries it"},
            "idempotency_key": {"type": "string", "description": "Only with an Idempotency-Key: the key"},
            "replayed": {"type": "boolean", "description": "Only with an Idempotency-Key: true when a message with this key was queued before and nothing was queued now"},
            "interrupted": {"type": ["string", "null"], "description": "Only with `interrupt`: the turn it cancelled, null when none ran"},
            "status": {"type": "string", "enum": ["completed", "failed", "cancelled", "waiting_for_approval", "running"], "description": "Only with `wait`: how the wait ended"},
            "turn_id": {"type": ["string", "null"], "description": "Only with `wait`: the message's turn; null while it is still queued"},
            "messages": {"type": "array", "items": r("AgentMessage"), "description": "Only when completed: the messages the turn added after the user's"},
            "usage": {"allOf": [r("AgentUsage")], "description": "Only when completed: what the turn's model calls used"},
            "error": {"type": "string", "description": "Only when failed"},
            "interrupts": {"type": "array", "items": r("AgentInterrupt"), "description": "Only when waiting_for_approval: the turn's pending approvals"}}},
        "TurnCancel": {"type": "object", "required": ["cancelled"], "properties": {
            "cancelled": {"type": "boolean", "description": "False when no turn was running"},
            "turn_id": {"type": "string", "description": "Only when cancelled: the turn"}}},
        "Resolved": {"type": "object", "required": ["resolved"], "properties": {"resolved": {"type": "boolean"}}},
        "Stopped": {"type": "object", "required": ["stopped"], "properties": {"stopped": {"type": "boolean"}}},
    })
}

/// The Step history and the event stream.
fn history_and_events() -> Value {
    json!({
        "StepHistory": {"type": "object", "required": ["steps", "next_after"], "properties": {
            "next_after": {"type": ["integer", "null"], "description": "Pass as `after` for the next page; null on the last page"},
            "steps": {"type": "array", "items": r("StepHistoryEntry")}}},
        "StepHistoryEntry": {"type": "object", "required": ["event_type", "step_type", "step_execution_id", "final_attempt", "at", "detail", "started_at"], "properties": {
            "event_type": {"type": "string", "enum": ["execute_completed", "attempt_failed", "execute_failed", "redelivered"]},
            "step_type": {"type": "string"}, "step_execution_id": {"type": "string"}, "final_attempt": {"type": "integer", "minimum": 1},
            "at": {"type": "integer", "description": "When the reported attempt ended (ms)"},
            "started_at": {"type": ["integer", "null"], "description": "When the reported attempt started (ms)"},
            "detail": {"type": ["string", "null"]},
            "component": {"type": "string", "pattern": "^[0-9a-f]{64}$", "description": "Only when the Step ran a component: the SHA-256 (hex) of the version (runner or tool) the reported attempt ran"}}},
        "EventType": {"type": "string", "enum": host_event_types(), "description": "The host's own event types"},
        "AgentEvent": {"type": "object", "required": ["type", "turn_id", "step_execution_id", "attempt", "data"], "properties": {
            "type": {"anyOf": [r("EventType"), {"type": "string", "description": "A guest's own event type (`origin` is `guest`)"}]},
            "turn_id": {"type": "string"}, "step_execution_id": {"type": "string", "description": "Shared by every attempt of one Step execution; empty on an event written outside a Step (`turn_cancel_requested`)"},
            "attempt": {"type": "integer", "minimum": 0, "description": "The Step attempt; 0 outside a Step"},
            "origin": {"type": "string", "enum": ["guest"], "description": "Only on an event a component wrote during its call"},
            "data": {"type": "object", "description": "By type, as the README lists; a guest's own event's payload is its own"}}},
        "EventStream": {"description": "One Server-Sent Event of the stream, by its fields (the schema of each item of a sequential media type)", "oneOf": [r("SseAgentEvent"), r("SseSessionEnded")]},
        "SseAgentEvent": {"type": "object", "required": ["id", "event", "data"], "properties": {
            "id": {"type": "string", "description": "The event's sequence; send it back as Last-Event-ID"},
            "event": {"type": "string", "not": {"const": "session_ended"}, "description": "The event's type"},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": r("AgentEvent")}}},
        "SseSessionEnded": {"type": "object", "required": ["id", "event", "data"], "properties": {
            "id": {"type": "string", "description": "The last event's sequence (0 when there was none)"},
            "event": {"const": "session_ended"},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": r("SessionEnded")}}},
        "SessionEnded": {"type": "object", "required": ["session_id", "status", "error"], "properties": {
            "session_id": {"type": "string"}, "status": r("FlowStatus"), "error": {"type": ["string", "null"]}}},
    })
}

/// The component catalog and activations.
fn catalog() -> Value {
    json!({
        "ComponentRecord": {"type": "object", "required": ["digest", "world", "wit_package", "tools", "size", "added_at", "added_by"], "properties": {
            "digest": {"type": "string", "description": "SHA-256 of the bytes, hex"}, "world": {"type": "string", "enum": ["runner", "tool"]},
            "wit_package": {"type": "string"}, "size": {"type": "integer"}, "added_at": {"type": "integer"}, "added_by": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "object", "required": ["name", "effect"], "properties": {
                "name": {"type": "string"}, "effect": {"type": ["string", "null"]}}}}}},
        "ComponentList": {"type": "object", "required": ["components"], "properties": {"components": {"type": "array", "items": r("ComponentRecord")}}},
        "ComponentAdded": {"type": "object", "required": ["component", "added"], "properties": {"component": r("ComponentRecord"), "added": {"type": "boolean"}}},
        "Activation": {"type": "object", "required": ["seq", "agent", "role", "digest", "mode", "upgrade_in_flight", "actor", "reason", "at"], "properties": {
            "seq": {"type": "integer"}, "agent": {"type": "string"}, "role": {"type": "string"}, "digest": {"type": "string"},
            "mode": {"type": "string", "enum": ["current", "ramp"]}, "percent": {"type": "integer", "description": "Only for a ramp"},
            "upgrade_in_flight": {"type": "boolean"}, "actor": {"type": "string"}, "reason": {"type": "string"}, "at": {"type": "integer"}}},
        "Activated": {"type": "object", "required": ["activation"], "properties": {"activation": r("Activation")}},
        "AgentVersions": {"type": "object", "properties": {
            "agent": {"type": "string"},
            "roles": {"type": "object", "additionalProperties": {"type": "object", "properties": {
                "current": {"type": ["string", "null"]}, "ramp": {"type": ["object", "null"]}, "upgrade_in_flight": {"type": "boolean"},
                "moving_off": {"type": "array", "items": {"type": "string"}, "description": "Versions an upgrade in flight moves open turns off, at their next RunModel"}}}},
            "log": {"type": "array", "items": r("Activation")}}},
    })
}
