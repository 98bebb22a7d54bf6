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
    /// Events refused for their form (a type that is no name, a payload that
    /// is no JSON object).
    malformed: AtomicU64,
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
                malformed: AtomicU64::new(0),
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

    /// Counts a malformed event; true for the call's first (warn once).
    fn malformed(&self) -> bool {
        self.inner.malformed.fetch_add(1, Ordering::Relaxed) == 0
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
        let valid_name = !event_type.is_empty()
            && event_type.len() <= 100
            && event_type
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':' | '/'));
        if !valid_name {
            if self.events.malformed() {
                tracing::warn!(
                    component = %self.component,
                    "dropped an event whose type is not a name of [A-Za-z0-9_.:/-], 1 to 100 bytes"
                );
            }
            return Ok(());
        }
        // What cannot fit the budget is not even parsed.
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
            _ => {
                if self.events.malformed() {
                    tracing::warn!(
                        component = %self.component,
                        event_type = %event_type,
                        "dropped an event whose payload is not a JSON object"
                    );
                }
                Ok(())
            }
        }
    }
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
