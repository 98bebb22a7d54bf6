//! `dex:agents/events`: live events of the session, tagged with the Step.
//!
//! A call gets an [`EventWriter`]; the host closes it when the call returns,
//! and anything written after that is dropped, as the spec requires.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use serde::Serialize;

use super::step::StepTag;
use crate::plugin::bindings::runner::dex::agents::events;
use crate::plugin::bindings::wit::ToolCallStatus;
use crate::plugin::call::CallState;

/// One event a guest (or the model provider, for text deltas) wrote.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum GuestEvent {
    TextDelta {
        text: String,
    },
    ReasoningDelta {
        text: String,
    },
    ToolCallStarted {
        tool_call_id: String,
        tool_name: String,
    },
    ToolCallFinished {
        tool_call_id: String,
        tool_name: String,
        status: String,
    },
    Custom {
        event_type: String,
        payload: serde_json::Value,
    },
    /// What the guest printed to stdout or stderr during the call, written
    /// by the host when the call ends (not a WIT import).
    GuestLog {
        component: String,
        stream: String,
        text: String,
        dropped_bytes: u64,
    },
}

/// What the host stores with every event besides the guest's own bytes (its
/// type, Step tag and framing), charged to the call's budget so that an
/// empty event is never free.
pub const EVENT_ENVELOPE_BYTES: u64 = 128;

impl GuestEvent {
    /// A text or reasoning delta with no text: it carries nothing and is
    /// dropped without a cost.
    pub fn is_empty_delta(&self) -> bool {
        matches!(
            self,
            GuestEvent::TextDelta { text } | GuestEvent::ReasoningDelta { text } if text.is_empty()
        )
    }

    /// Bytes the host stores for this event's strings: as JSON text, so
    /// with their escapes (a control character takes six bytes).
    pub fn stored_bytes(&self) -> u64 {
        let strings = |texts: &[&String]| texts.iter().map(|t| json_len(t)).sum::<usize>();
        let len = match self {
            GuestEvent::TextDelta { text } | GuestEvent::ReasoningDelta { text } => json_len(text),
            GuestEvent::ToolCallStarted {
                tool_call_id,
                tool_name,
            } => strings(&[tool_call_id, tool_name]),
            GuestEvent::ToolCallFinished {
                tool_call_id,
                tool_name,
                status,
            } => strings(&[tool_call_id, tool_name, status]),
            GuestEvent::Custom {
                event_type,
                payload,
            } => event_type.len() + payload.to_string().len(),
            GuestEvent::GuestLog {
                component,
                stream,
                text,
                ..
            } => strings(&[component, stream, text]) + 20,
        };
        len as u64
    }
}

/// The length of `text` as a JSON string's contents.
pub fn json_len(text: &str) -> usize {
    text.len()
        + text
            .bytes()
            .map(|b| match b {
                b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 1,
                0..=0x1f => 5,
                _ => 0,
            })
            .sum::<usize>()
}

/// An event with the Step it belongs to.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TaggedEvent {
    #[serde(flatten)]
    pub tag: StepTag,
    #[serde(flatten)]
    pub event: GuestEvent,
}

/// Where events go: the session's stream, a test's collector, or nowhere.
pub trait EventSink: Send + Sync {
    fn write(&self, event: TaggedEvent);

    /// What storing `event` will cost, in bytes, charged to the call's event
    /// budget before [`EventSink::write`]. By default its bytes plus a full
    /// envelope; a sink that merges deltas into an entry it already holds
    /// charges only the bytes it adds.
    fn stored_cost(&self, event: &TaggedEvent) -> u64 {
        event.event.stored_bytes() + EVENT_ENVELOPE_BYTES
    }
}

/// Drops every event.
pub struct NoEvents;

impl EventSink for NoEvents {
    fn write(&self, _event: TaggedEvent) {}
}

/// Why the writer refused an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventRefusal {
    /// The call already returned; the event was dropped.
    Closed,
    /// The call wrote more than its event budget.
    OverBudget { limit: u64 },
}

struct WriterInner {
    tag: StepTag,
    sink: Arc<dyn EventSink>,
    open: AtomicBool,
    /// What the stored events cost so far (see [`EventSink::stored_cost`]).
    bytes_written: AtomicU64,
    byte_limit: u64,
    dropped_after_close: AtomicU64,
    dropped_over_budget: AtomicU64,
    /// Custom events dropped for being over [`MAX_EVENT_PAYLOAD_BYTES`].
    dropped_oversized: AtomicU64,
}

/// Writes events for one call, tagged with its Step. Cheap to clone.
#[derive(Clone)]
pub struct EventWriter {
    inner: Arc<WriterInner>,
}

impl EventWriter {
    pub fn new(tag: StepTag, sink: Arc<dyn EventSink>, byte_limit: u64) -> Self {
        Self {
            inner: Arc::new(WriterInner {
                tag,
                sink,
                open: AtomicBool::new(true),
                bytes_written: AtomicU64::new(0),
                byte_limit,
                dropped_after_close: AtomicU64::new(0),
                dropped_over_budget: AtomicU64::new(0),
                dropped_oversized: AtomicU64::new(0),
            }),
        }
    }

    pub fn tag(&self) -> &StepTag {
        &self.inner.tag
    }

    /// Writes one event, unless the call has returned or its budget is spent.
    /// The budget counts what the sink will store (an envelope per new entry),
    /// not what the guest sent, so a flood of empty events spends it too; an
    /// empty delta stores nothing and is dropped for free.
    pub fn write(&self, event: GuestEvent) -> Result<(), EventRefusal> {
        let inner = &self.inner;
        if !inner.open.load(Ordering::Acquire) {
            inner.dropped_after_close.fetch_add(1, Ordering::Relaxed);
            return Err(EventRefusal::Closed);
        }
        if event.is_empty_delta() {
            return Ok(());
        }
        let event = TaggedEvent {
            tag: inner.tag.clone(),
            event,
        };
        let cost = inner.sink.stored_cost(&event);
        let spent = inner.bytes_written.load(Ordering::Relaxed);
        if spent.saturating_add(cost) > inner.byte_limit {
            inner.dropped_over_budget.fetch_add(1, Ordering::Relaxed);
            return Err(EventRefusal::OverBudget {
                limit: inner.byte_limit,
            });
        }
        inner.bytes_written.fetch_add(cost, Ordering::Relaxed);
        inner.sink.write(event);
        Ok(())
    }

    /// The call's event budget, in stored bytes.
    pub fn byte_limit(&self) -> u64 {
        self.inner.byte_limit
    }

    /// What the events written so far cost, in stored bytes.
    pub fn bytes_written(&self) -> u64 {
        self.inner.bytes_written.load(Ordering::Relaxed)
    }

    /// How many events were dropped because the budget was spent.
    pub fn dropped_over_budget(&self) -> u64 {
        self.inner.dropped_over_budget.load(Ordering::Relaxed)
    }

    /// Whether `bytes` more could still fit the budget: checked before a
    /// guest's payload is parsed, so that one over the budget costs the host
    /// no parse. Counts a refusal when it cannot.
    fn affords(&self, bytes: u64) -> bool {
        let inner = &self.inner;
        let spent = inner.bytes_written.load(Ordering::Relaxed);
        if spent.saturating_add(bytes) > inner.byte_limit {
            inner.dropped_over_budget.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Counts an event dropped for its size; true for the call's first
    /// (warn once).
    fn refuse_oversized(&self) -> bool {
        self.inner.dropped_oversized.fetch_add(1, Ordering::Relaxed) == 0
    }

    /// Called when the call returns; later writes are dropped.
    pub fn close(&self) {
        self.inner.open.store(false, Ordering::Release);
    }

    /// How many writes arrived after [`Self::close`].
    pub fn dropped_after_close(&self) -> u64 {
        self.inner.dropped_after_close.load(Ordering::Relaxed)
    }
}

/// The wire name of a tool-call status, as the spec's records carry it.
pub fn status_name(status: ToolCallStatus) -> &'static str {
    match status {
        ToolCallStatus::Pending => "pending",
        ToolCallStatus::Approved => "approved",
        ToolCallStatus::Succeeded => "succeeded",
        ToolCallStatus::Failed => "failed",
        ToolCallStatus::Rejected => "rejected",
        ToolCallStatus::OutcomeUnknown => "outcome_unknown",
    }
}

impl CallState {
    fn emit(&mut self, event: GuestEvent) -> wasmtime::Result<()> {
        match self.events.write(event) {
            Ok(()) | Err(EventRefusal::Closed) => Ok(()),
            // Events are best effort: past the budget they are dropped, with
            // one warning per call, and the call goes on.
            Err(EventRefusal::OverBudget { limit }) => {
                self.warn_over_budget(limit);
                Ok(())
            }
        }
    }

    fn warn_over_budget(&self, limit: u64) {
        if self.events.dropped_over_budget() == 1 {
            tracing::warn!(
                component = %self.component,
                limit,
                "the call spent its event budget; its further events are dropped"
            );
        }
    }
}

impl events::Host for CallState {
    fn write_text_delta(&mut self, text: String) -> wasmtime::Result<()> {
        self.emit(GuestEvent::TextDelta { text })
    }

    fn write_reasoning_delta(&mut self, text: String) -> wasmtime::Result<()> {
        self.emit(GuestEvent::ReasoningDelta { text })
    }

    fn write_tool_call_started(
        &mut self,
        tool_call_id: String,
        tool_name: String,
    ) -> wasmtime::Result<()> {
        self.emit(GuestEvent::ToolCallStarted {
            tool_call_id,
            tool_name,
        })
    }

    fn write_tool_call_finished(
        &mut self,
        tool_call_id: String,
        tool_name: String,
        status: ToolCallStatus,
    ) -> wasmtime::Result<()> {
        self.emit(GuestEvent::ToolCallFinished {
            tool_call_id,
            tool_name,
            status: status_name(status).to_string(),
        })
    }

    fn write_event(&mut self, event_type: String, payload: String) -> wasmtime::Result<()> {
        // A type is a name: it becomes an SSE `event:` line, which cannot
        // hold a line break.
        if !is_event_type_name(&event_type) {
            return Err(wasmtime::format_err!(
                "write-event: the event type {} is not a name of [A-Za-z0-9_.:/-], 1 to 100 bytes",
                preview(&event_type)
            ));
        }
        // The interface promises a JSON object no deeper than the readers
        // can take back; anything else fails the call. The check is one pass
        // that allocates nothing.
        check_payload_shape(&payload).map_err(|reason| {
            wasmtime::format_err!("write-event {event_type:?}: the payload {reason}")
        })?;
        // What cannot fit the budget is not parsed: it is dropped like any
        // event past the budget. Nor is one event over its own cap, whatever
        // the budget: parsing into a tree takes many times the text's size.
        if payload.len() > MAX_EVENT_PAYLOAD_BYTES {
            if self.events.refuse_oversized() {
                tracing::warn!(
                    component = %self.component,
                    event_type = %event_type,
                    bytes = payload.len(),
                    limit = MAX_EVENT_PAYLOAD_BYTES,
                    "dropped an event whose payload is over the size one event may have"
                );
            }
            return Ok(());
        }
        let size = (event_type.len() + payload.len()) as u64 + EVENT_ENVELOPE_BYTES;
        if !self.events.affords(size) {
            self.warn_over_budget(self.events.byte_limit());
            return Ok(());
        }
        match serde_json::from_str::<serde_json::Value>(&payload) {
            Ok(payload @ serde_json::Value::Object(_)) => self.emit(GuestEvent::Custom {
                event_type,
                payload,
            }),
            Ok(_) => Err(wasmtime::format_err!(
                "write-event {event_type:?}: the payload is not a JSON object"
            )),
            Err(err) => Err(wasmtime::format_err!(
                "write-event {event_type:?}: the payload is not valid JSON: {err}"
            )),
        }
    }
}

/// The largest payload one custom event may have, whatever the call's
/// budget; a larger one is dropped with a warning and the call goes on.
pub const MAX_EVENT_PAYLOAD_BYTES: usize = 256 << 10;

/// How deep a custom event's payload may nest (objects and arrays). The
/// stored entry wraps the payload in two more levels, and every reader
/// parses with serde_json's limit of 128: whatever is accepted here must be
/// readable back.
pub const MAX_EVENT_PAYLOAD_DEPTH: usize = 64;

/// Whether `name` may be an event type (and so an SSE `event:` line).
fn is_event_type_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 100
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':' | '/'))
}

/// The first bytes of a guest's string, quoted, for an error message.
fn preview(text: &str) -> String {
    let mut end = text.len().min(100);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if end < text.len() {
        format!("{:?}... ({} bytes)", &text[..end], text.len())
    } else {
        format!("{text:?}")
    }
}

/// Checks, in one pass and without allocating, that `payload` starts as a
/// JSON object and nests at most [`MAX_EVENT_PAYLOAD_DEPTH`] deep. Whether it
/// is valid JSON is left to the parser, which then never meets deep input.
pub fn check_payload_shape(payload: &str) -> Result<(), String> {
    if !payload.trim_start().starts_with('{') {
        return Err("is not a JSON object".to_string());
    }
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for byte in payload.bytes() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > MAX_EVENT_PAYLOAD_DEPTH {
                    return Err(format!(
                        "nests deeper than {MAX_EVENT_PAYLOAD_DEPTH} levels"
                    ));
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer(limit: u64) -> EventWriter {
        let tag = StepTag {
            flow_id: "s".into(),
            turn_id: "turn-1".into(),
            step_execution_id: "sx-1".into(),
            attempt: 1,
        };
        EventWriter::new(tag, Arc::new(NoEvents), limit)
    }

    #[test]
    fn empty_events_spend_the_budget_by_what_they_store() {
        let writer = writer(1 << 20);
        let mut stored = 0;
        for _ in 0..1_000_000 {
            let event = GuestEvent::ToolCallStarted {
                tool_call_id: String::new(),
                tool_name: String::new(),
            };
            if writer.write(event).is_ok() {
                stored += 1;
            }
        }
        assert_eq!(stored, (1 << 20) / EVENT_ENVELOPE_BYTES);
        assert_eq!(writer.dropped_over_budget(), 1_000_000 - stored);
    }

    #[test]
    fn escapes_count_as_stored() {
        assert_eq!(json_len("plain"), 5);
        assert_eq!(json_len("a\"b\\c\n"), 9);
        assert_eq!(json_len("\u{1}"), 6);
        assert_eq!(
            json_len(&"\u{1}".repeat(10)),
            serde_json::to_string(&"\u{1}".repeat(10)).map_or(0, |t| t.len() - 2)
        );
    }

    #[test]
    fn a_payload_must_be_an_object_no_deeper_than_the_limit() {
        let nested = |depth: usize| {
            format!(
                "{}{{}}{}",
                "{\"a\":".repeat(depth - 1),
                "}".repeat(depth - 1)
            )
        };
        assert_eq!(
            check_payload_shape(&nested(MAX_EVENT_PAYLOAD_DEPTH)),
            Ok(())
        );
        assert!(check_payload_shape(&nested(MAX_EVENT_PAYLOAD_DEPTH + 1))
            .is_err_and(|e| e.contains("nests deeper than 64")));
        // Arrays count as levels; brackets inside strings do not.
        let arrays = format!("{{\"a\":{}{}}}", "[".repeat(64), "]".repeat(64));
        assert!(check_payload_shape(&arrays).is_err());
        let quoted = format!("{{\"a\":\"{}\\\"{}\"}}", "[".repeat(500), "{".repeat(500));
        assert_eq!(check_payload_shape(&quoted), Ok(()));
        for not_object in ["[1]", "1", "\"x\"", "", "null", " [{}]"] {
            assert!(
                check_payload_shape(not_object).is_err_and(|e| e == "is not a JSON object"),
                "{not_object:?}"
            );
        }
    }

    #[test]
    fn an_empty_delta_is_dropped_without_a_cost() {
        let writer = writer(1 << 10);
        for _ in 0..100_000 {
            writer
                .write(GuestEvent::TextDelta {
                    text: String::new(),
                })
                .expect("an empty delta is no refusal");
        }
        assert_eq!(writer.bytes_written(), 0);
    }
}
