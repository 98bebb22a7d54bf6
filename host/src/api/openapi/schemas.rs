//! The document's schemas, derived from the types the handlers answer with
//! and take (`JsonSchema` derives beside their `Serialize`/`Deserialize`):
//! answers as they serialize, request bodies as they deserialize. A field
//! listed in `required` is in every answer; the others say when they are
//! sent. Only the Server-Sent Events framing around the event type is
//! written here, because an SSE stream is not JSON.

use schemars::generate::{SchemaGenerator, SchemaSettings};
use schemars::transform::{transform_subschemas, Transform};
use schemars::{JsonSchema, Schema};
use serde_json::{json, Map, Value};

use crate::api::answers::SessionEnded;
use crate::session::event_data::AgentEventSchema;

/// Where the generators put their definitions: the document's components.
const DEFINITIONS: &str = "/components/schemas";

/// Two generators: one for answers, as the handlers serialize them, and one
/// for request bodies, as they deserialize them (a field with a default is
/// optional in a body; one that is always sent is required in an answer).
pub(super) struct Schemas {
    answers: SchemaGenerator,
    bodies: SchemaGenerator,
}

impl Schemas {
    pub fn new() -> Self {
        let settings = || {
            SchemaSettings::draft2020_12()
                .with(|s| {
                    s.definitions_path = DEFINITIONS.into();
                    s.meta_schema = None;
                })
                .with_transform(NoNullDefaults)
        };
        Self {
            answers: settings()
                .with_transform(NoDefaults)
                .for_serialize()
                .into_generator(),
            bodies: settings().for_deserialize().into_generator(),
        }
    }

    /// A `$ref` to the schema of answer type `T`.
    pub fn answer<T: JsonSchema>(&mut self) -> Value {
        self.answers.subschema_for::<T>().to_value()
    }

    /// A `$ref` to the schema of request body type `T`.
    pub fn body<T: JsonSchema>(&mut self) -> Value {
        self.bodies.subschema_for::<T>().to_value()
    }

    /// Every schema referenced so far, with the event stream's. An answer
    /// and a body type never share a name (the unit tests build the
    /// document in a debug build, where that fails).
    pub fn into_components(mut self) -> Value {
        let events = self.event_stream();
        let mut all: Map<String, Value> = self.answers.take_definitions(true);
        for (name, schema) in self.bodies.take_definitions(true) {
            debug_assert!(
                all.get(&name).is_none_or(|answer| answer == &schema),
                "{name} is both an answer and a request body, with different schemas"
            );
            all.entry(name).or_insert(schema);
        }
        all.extend(events);
        Value::Object(all)
    }

    /// The SSE route's schemas: one event of the stream by its fields (the
    /// schema of each item of a sequential media type), its `data` given as
    /// JSON of the generated event schemas.
    fn event_stream(&mut self) -> Map<String, Value> {
        let event = self.answers.subschema_for::<AgentEventSchema>().to_value();
        let ended = self.answers.subschema_for::<SessionEnded>().to_value();
        let schemas = json!({
            "EventStream": {"description": "One Server-Sent Event of the stream, by its fields (the schema of each item of a sequential media type)", "oneOf": [r("SseAgentEvent"), r("SseSessionEnded")]},
            "SseAgentEvent": {"type": "object", "required": ["id", "event", "data"], "properties": {
                "id": {"type": "string", "description": "The event's sequence; send it back as Last-Event-ID"},
                "event": {"type": "string", "not": {"const": "session_ended"}, "description": "The event's type"},
                "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": event}}},
            "SseSessionEnded": {"type": "object", "required": ["id", "event", "data"], "properties": {
                "id": {"type": "string", "description": "The last event's sequence (0 when there was none)"},
                "event": {"const": "session_ended"},
                "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": ended}}},
        });
        match schemas {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }
}

/// Drops the `"default": null` a derive gives an optional field whose
/// default is `None`: absent already says it, and a non-nullable schema
/// (`ramp`, an integer) with a null default is not a valid document.
#[derive(Clone, Copy)]
struct NoNullDefaults;

impl Transform for NoNullDefaults {
    fn transform(&mut self, schema: &mut Schema) {
        if schema.get("default").is_some_and(Value::is_null) {
            schema.remove("default");
        }
        transform_subschemas(self, schema);
    }
}

/// Drops every `default` of an answer's schema: an answer has no defaults,
/// it sends what it sends (`#[serde(default)]` is for reading it back).
#[derive(Clone, Copy)]
struct NoDefaults;

impl Transform for NoDefaults {
    fn transform(&mut self, schema: &mut Schema) {
        schema.remove("default");
        transform_subschemas(self, schema);
    }
}

/// A `$ref` to schema `name` of this file.
fn r(name: &str) -> Value {
    json!({"$ref": format!("#{DEFINITIONS}/{name}")})
}
