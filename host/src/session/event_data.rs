//! The `data` of each event type the host writes to a session's stream, as
//! types: the Steps write these, and the OpenAPI document's event schemas
//! are derived from them, so what a client is told an event carries is what
//! the host sends. A guest's own events carry its own payload.

use std::borrow::Cow;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
use serde::Serialize;

use super::events::session_event;
use super::records::{event_type, AgentEvent, AgentUsage, ToolEffect, ORIGIN_GUEST};
use crate::flow::{Json, StoreMillis};
use crate::plugin::StepTag;

/// The data of one event type.
pub trait EventData: Serialize + JsonSchema {
    /// The event's `type`.
    const TYPE: &'static str;
}

/// This event, tagged with the Step that writes it.
pub fn host_event<D: EventData>(tag: &StepTag, data: &D) -> Json {
    session_event(
        tag,
        D::TYPE,
        serde_json::to_value(data).unwrap_or(Json::Null),
    )
}

macro_rules! event_data {
    ($($ty:ident => $name:expr),* $(,)?) => {
        $(impl EventData for $ty {
            const TYPE: &'static str = $name;
        })*

        /// Each host event type's name and the schema of its data, in the
        /// generator's definitions.
        pub fn data_schemas(generator: &mut SchemaGenerator) -> Vec<(&'static str, Schema)> {
            vec![$(($name, generator.subschema_for::<$ty>())),*]
        }
    };
}

event_data! {
    TurnStarted => event_type::TURN_STARTED,
    TurnCompleted => event_type::TURN_COMPLETED,
    TurnFailed => event_type::TURN_FAILED,
    TurnCancelRequested => event_type::TURN_CANCEL_REQUESTED,
    TurnCancelled => event_type::TURN_CANCELLED,
    TextDelta => event_type::TEXT_DELTA,
    ReasoningDelta => event_type::REASONING_DELTA,
    ToolCallStarted => event_type::TOOL_CALL_STARTED,
    ToolCallFinished => event_type::TOOL_CALL_FINISHED,
    ToolCallDeferred => event_type::TOOL_CALL_DEFERRED,
    InterruptRaised => event_type::INTERRUPT_RAISED,
    InterruptResolved => event_type::INTERRUPT_RESOLVED,
    UsageRecorded => event_type::USAGE_RECORDED,
    VersionChanged => event_type::VERSION_CHANGED,
    HistoryCompacted => event_type::HISTORY_COMPACTED,
    GuestLog => event_type::GUEST_LOG,
}

/// A turn began with a user message.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "TurnStartedData", transform = turn_started_since)]
pub struct TurnStarted {
    /// The user message's sequence.
    pub sequence: u64,
    /// The runner version (digest) the turn is pinned to. Always sent;
    /// absent only from events an older dexa stored.
    pub runner: Option<String>,
    /// The id the send answered with; null for a message queued before ids
    /// were given. Always sent; absent only from events an older dexa
    /// stored.
    pub message_id: Option<String>,
}

/// A stream sends stored events as they were stored, and older versions of
/// dexa wrote some fields this one always writes: those are not `required`.
fn written_since(schema: &mut Schema, fields: &[&str]) {
    if let Some(required) = schema.get_mut("required").and_then(|r| r.as_array_mut()) {
        required.retain(|name| !name.as_str().is_some_and(|name| fields.contains(&name)));
    }
}

fn turn_started_since(schema: &mut Schema) {
    written_since(schema, &["runner", "message_id"]);
}

fn tool_call_deferred_since(schema: &mut Schema) {
    written_since(schema, &["component", "digest"]);
}

fn usage_recorded_since(schema: &mut Schema) {
    written_since(schema, &["context"]);
}

/// The runner ended the turn.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "TurnCompletedData")]
pub struct TurnCompleted {
    /// The messages the turn's last model call added.
    pub message_count: u64,
}

/// The turn failed, or a queued message was given up before its turn ran.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "TurnFailedData")]
pub struct TurnFailed {
    pub error: String,
    /// Only when the turn never started: the message given up.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub message_id: Option<Option<String>>,
}

/// A cancel (or a steering message) was accepted; `turn_cancelled` follows.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "TurnCancelRequestedData")]
pub struct TurnCancelRequested {
    /// True when a message with `interrupt` asked for it.
    pub steered: bool,
}

/// The turn was cancelled.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "TurnCancelledData")]
pub struct TurnCancelled {
    /// Tool calls recorded `cancelled`.
    pub cancelled_tool_calls: u32,
    /// Single-attempt writes that had started, recorded `outcome_unknown`.
    pub outcome_unknown_tool_calls: u32,
    /// True when a steering message cancelled it.
    pub steered: bool,
    /// Why the note for the next turn could not be built, if it could not.
    pub note_error: Option<String>,
}

/// Text the model streamed.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "TextDeltaData")]
pub struct TextDelta {
    pub text: String,
}

/// Reasoning the model streamed.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "ReasoningDeltaData")]
pub struct ReasoningDelta {
    pub text: String,
}

/// A tool call began to run.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "ToolCallStartedData")]
pub struct ToolCallStarted {
    pub tool_call_id: String,
    pub tool_name: String,
}

/// A tool call's record became final.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "ToolCallFinishedData")]
pub struct ToolCallFinished {
    pub tool_call_id: String,
    pub tool_name: String,
    /// The record's status (`succeeded`, `failed`, ...); a guest's own
    /// event carries what the guest wrote.
    pub status: String,
}

/// The model asked for a tool call; its record was written.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "ToolCallDeferredData", transform = tool_call_deferred_since)]
pub struct ToolCallDeferred {
    pub tool_call_id: String,
    pub tool_name: String,
    pub effect: ToolEffect,
    pub requires_approval: bool,
    /// The tool component that runs it; null when the runner does. Always
    /// sent; absent only from events an older dexa stored.
    pub component: Option<String>,
    /// The version it is pinned to. Always sent; absent only from events
    /// an older dexa stored.
    pub digest: Option<String>,
}

/// A tool call waits for a person's approval.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "InterruptRaisedData")]
pub struct InterruptRaised {
    pub interrupt_id: String,
    pub tool_call_id: String,
    pub tool_name: String,
    /// When it expires (ms, store clock); null waits forever.
    pub deadline: Option<StoreMillis>,
}

/// An interrupt was answered, or expired.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "InterruptResolvedData")]
pub struct InterruptResolved {
    pub interrupt_id: String,
    pub approved: bool,
    pub rejection_message: Option<String>,
    /// True when its deadline passed unanswered.
    pub expired: bool,
}

/// A model call's usage, and what the call cost the host.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "UsageRecordedData", transform = usage_recorded_since)]
pub struct UsageRecorded {
    /// This call's.
    pub recorded: AgentUsage,
    /// The session's so far.
    pub session: AgentUsage,
    /// Always sent; absent only from events an older dexa stored.
    pub context: ContextCost,
}

/// What handing the runner its context cost.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ContextCost {
    /// History pages the runner read.
    pub history_reads: u64,
    /// Messages in those pages.
    pub messages_read: u64,
    /// The turn context and every page, in bytes.
    pub guest_input_bytes: u64,
    /// RunModel's time outside the guest, with the page reads.
    pub host_micros: u64,
}

/// An upgrade in flight moved the turn to another runner version.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "VersionChangedData")]
pub struct VersionChanged {
    pub from: String,
    pub to: String,
    pub why: String,
}

/// The runner compacted the history.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "HistoryCompactedData")]
pub struct HistoryCompacted {
    /// The summary stands for every message up to this one.
    pub through_sequence: u64,
}

/// What a component printed during its call.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "GuestLogData")]
pub struct GuestLog {
    /// The component's name in `dexa.toml`.
    pub component: String,
    /// `stdout` or `stderr`.
    pub stream: String,
    pub text: String,
    /// Bytes over the call's log cap, not kept.
    pub dropped_bytes: u64,
}

/// The schema of one stored event: a `oneOf` of the host's event types,
/// each a named schema (`TurnStartedEvent`, ...): the [`AgentEvent`]
/// envelope as derived, with its `type` fixed and its own `data`; and a
/// guest's own event (`GuestEvent`), whose type is none of the host's.
pub(crate) fn agent_event_schema(generator: &mut SchemaGenerator) -> Schema {
    let data = data_schemas(generator);
    let names: Vec<&str> = data.iter().map(|(name, _)| *name).collect();
    let event_types = named(
        generator,
        "EventType",
        json_schema!({"type": "string", "enum": names,
            "description": "The host's own event types (a guest's own events add others)"}),
    );
    let envelope = AgentEvent::json_schema(generator);
    let variant = |kind: Schema, data: Schema, description: String| -> Schema {
        let mut schema = envelope.clone();
        schema.insert("description".into(), description.into());
        if let Some(properties) = schema.get_mut("properties").and_then(|p| p.as_object_mut()) {
            properties.insert("type".into(), kind.to_value());
            properties.insert("data".into(), data.to_value());
        }
        schema
    };
    let mut variants = Vec::new();
    for (name, data) in data {
        let schema = variant(
            json_schema!({"type": "string", "const": name}),
            data,
            format!("A `{name}` event"),
        );
        variants.push(named(generator, &format!("{}Event", camel(name)), schema));
    }
    let guest = variant(
        json_schema!({"type": "string", "description": "A guest's own event type: none of the host's, nor `session_ended`",
            "not": {"anyOf": [event_types, {"const": event_type::SESSION_ENDED}]}}),
        json_schema!({"type": "object", "description": "The guest's own payload"}),
        format!(
            "A guest's own event: `origin` is `{ORIGIN_GUEST}` (absent only from events an older dexa stored)"
        ),
    );
    variants.push(named(generator, "GuestEvent", guest));
    json_schema!({
        "description": "One event of a session's stream: the host's own types, each with its data, or a guest's own event",
        "oneOf": variants,
    })
}

/// Puts `schema` in the generator's definitions as `name`; a `$ref` to it.
fn named(generator: &mut SchemaGenerator, name: &str, schema: Schema) -> Schema {
    let schema = schema.to_value();
    let earlier = generator
        .definitions_mut()
        .insert(name.to_string(), schema.clone());
    debug_assert!(
        earlier.is_none_or(|earlier| earlier == schema),
        "two schemas named {name}"
    );
    let path = generator.settings().definitions_path.clone();
    json_schema!({"$ref": format!("#{path}/{name}")})
}

/// `turn_started` as `TurnStarted`.
fn camel(snake: &str) -> String {
    snake
        .split('_')
        .map(|word| {
            let mut chars = word.chars();
            match chars.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + chars.as_str(),
                None => String::new(),
            }
        })
        .collect()
}

/// The host's event types, in the order of [`data_schemas`].
#[cfg(test)]
pub(crate) fn host_event_types() -> Vec<&'static str> {
    data_schemas(&mut SchemaGenerator::default())
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}

/// Marker for the generated `AgentEvent` schema.
pub struct AgentEventSchema;

impl JsonSchema for AgentEventSchema {
    fn schema_name() -> Cow<'static, str> {
        "AgentEvent".into()
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        agent_event_schema(generator)
    }
}

#[cfg(test)]
mod tests {
    use schemars::generate::SchemaSettings;
    use serde_json::json;

    use super::*;

    fn tag() -> StepTag {
        StepTag {
            flow_id: "s".into(),
            turn_id: "turn-1".into(),
            step_execution_id: "x".into(),
            attempt: 1,
        }
    }

    fn validator() -> jsonschema::Validator {
        let mut generator = SchemaSettings::draft2020_12()
            .for_serialize()
            .into_generator();
        let root = generator.root_schema_for::<AgentEventSchema>();
        jsonschema::validator_for(root.as_value()).expect("the generated schema compiles")
    }

    fn usage() -> AgentUsage {
        AgentUsage {
            input_tokens: 1,
            output_tokens: 2,
            total_tokens: 3,
            model_calls: 1,
        }
    }

    /// One event of every host type, as the Steps write them.
    fn every_host_event() -> Vec<Json> {
        let t = tag();
        let s = |text: &str| text.to_string();
        vec![
            host_event(
                &t,
                &TurnStarted {
                    sequence: 1,
                    runner: Some(s("d")),
                    message_id: None,
                },
            ),
            host_event(&t, &TurnCompleted { message_count: 2 }),
            host_event(
                &t,
                &TurnFailed {
                    error: s("e"),
                    message_id: Some(None),
                },
            ),
            host_event(
                &t,
                &TurnFailed {
                    error: s("e"),
                    message_id: None,
                },
            ),
            host_event(&t, &TurnCancelRequested { steered: true }),
            host_event(
                &t,
                &TurnCancelled {
                    cancelled_tool_calls: 1,
                    outcome_unknown_tool_calls: 0,
                    steered: false,
                    note_error: None,
                },
            ),
            host_event(&t, &TextDelta { text: s("hi") }),
            host_event(&t, &ReasoningDelta { text: s("hm") }),
            host_event(
                &t,
                &ToolCallStarted {
                    tool_call_id: s("c"),
                    tool_name: s("n"),
                },
            ),
            host_event(
                &t,
                &ToolCallFinished {
                    tool_call_id: s("c"),
                    tool_name: s("n"),
                    status: s("succeeded"),
                },
            ),
            host_event(
                &t,
                &ToolCallDeferred {
                    tool_call_id: s("c"),
                    tool_name: s("n"),
                    effect: ToolEffect::Read,
                    requires_approval: false,
                    component: None,
                    digest: Some(s("d")),
                },
            ),
            host_event(
                &t,
                &InterruptRaised {
                    interrupt_id: s("turn-1/c"),
                    tool_call_id: s("c"),
                    tool_name: s("n"),
                    deadline: Some(5),
                },
            ),
            host_event(
                &t,
                &InterruptResolved {
                    interrupt_id: s("turn-1/c"),
                    approved: false,
                    rejection_message: Some(s("no")),
                    expired: false,
                },
            ),
            host_event(
                &t,
                &UsageRecorded {
                    recorded: usage(),
                    session: usage(),
                    context: ContextCost {
                        history_reads: 1,
                        messages_read: 2,
                        guest_input_bytes: 3,
                        host_micros: 4,
                    },
                },
            ),
            host_event(
                &t,
                &VersionChanged {
                    from: s("a"),
                    to: s("b"),
                    why: s("c"),
                },
            ),
            host_event(
                &t,
                &HistoryCompacted {
                    through_sequence: 3,
                },
            ),
            host_event(
                &t,
                &GuestLog {
                    component: s("c"),
                    stream: s("stderr"),
                    text: s("t"),
                    dropped_bytes: 0,
                },
            ),
        ]
    }

    #[test]
    fn every_host_event_matches_the_generated_event_schema() {
        let validator = validator();
        let events = every_host_event();
        let mut types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
        types.dedup();
        assert_eq!(types, host_event_types(), "one sample per host type");
        for event in &events {
            let errors: Vec<String> = validator
                .iter_errors(event)
                .map(|e| e.to_string())
                .collect();
            assert!(errors.is_empty(), "{event}: {errors:?}");
        }
        // A guest's own event carries its own payload.
        let custom = json!({"type": "my_progress", "turn_id": "turn-1", "step_execution_id": "x",
            "attempt": 1, "origin": ORIGIN_GUEST, "data": {"any": [1, "thing"]}});
        assert!(validator.is_valid(&custom));
        // ...and no host type is taken for one.
        let mut forged = custom.clone();
        forged["type"] = json!(event_type::TURN_COMPLETED);
        assert!(!validator.is_valid(&forged));
        // An event an older dexa stored, without the fields added since.
        let mut older = host_event(
            &tag(),
            &TurnStarted {
                sequence: 1,
                runner: None,
                message_id: None,
            },
        );
        older["data"] = json!({"sequence": 1});
        assert!(validator.is_valid(&older));
    }

    #[test]
    fn an_event_whose_data_is_not_its_types_does_not_match() {
        let validator = validator();
        let mut missing = host_event(&tag(), &TurnCompleted { message_count: 2 });
        missing["data"] = json!({});
        assert!(!validator.is_valid(&missing));
        // A host type under another type's data.
        let mut swapped = host_event(&tag(), &TextDelta { text: "x".into() });
        swapped["type"] = json!(event_type::TURN_STARTED);
        assert!(!validator.is_valid(&swapped));
    }

    #[test]
    fn a_guest_may_write_no_type_the_host_types() {
        let reserved = super::super::events::RESERVED;
        for typed in host_event_types() {
            assert!(reserved.contains(&typed), "{typed}");
        }
        // ...nor the name of the stream's last event.
        assert!(reserved.contains(&event_type::SESSION_ENDED));
        assert_eq!(reserved.len(), host_event_types().len() + 1);
    }
}
