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

impl GuestEvent {
    /// Bytes the guest pushed across the boundary for this event.
    fn guest_bytes(&self) -> u64 {
        let len = match self {
            GuestEvent::TextDelta { text } | GuestEvent::ReasoningDelta { text } => text.len(),
            GuestEvent::ToolCallStarted {
                tool_call_id,
                tool_name,
            } => tool_call_id.len() + tool_name.len(),
            GuestEvent::ToolCallFinished {
                tool_call_id,
                tool_name,
                status,
            } => tool_call_id.len() + tool_name.len() + status.len(),
            GuestEvent::Custom {
                event_type,
                payload,
            } => event_type.len() + payload.to_string().len(),
        };
        len as u64
    }
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
    bytes_written: AtomicU64,
    byte_limit: u64,
    dropped_after_close: AtomicU64,
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
            }),
        }
    }

    pub fn tag(&self) -> &StepTag {
        &self.inner.tag
    }

    /// Writes one event, unless the call has returned or its budget is spent.
    pub fn write(&self, event: GuestEvent) -> Result<(), EventRefusal> {
        let inner = &self.inner;
        if !inner.open.load(Ordering::Acquire) {
            inner.dropped_after_close.fetch_add(1, Ordering::Relaxed);
            return Err(EventRefusal::Closed);
        }
        let size = event.guest_bytes();
        let total = inner.bytes_written.fetch_add(size, Ordering::Relaxed) + size;
        if total > inner.byte_limit {
            return Err(EventRefusal::OverBudget {
                limit: inner.byte_limit,
            });
        }
        inner.sink.write(TaggedEvent {
            tag: inner.tag.clone(),
            event,
        });
        Ok(())
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
            // A flood of events fails the call instead of filling the stream.
            Err(EventRefusal::OverBudget { limit }) => {
                let reason = format!("it wrote more than {limit} bytes of events in one call");
                self.note_limit(reason.clone());
                Err(wasmtime::format_err!(reason))
            }
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
            tracing::warn!(
                component = %self.component,
                "dropped an event whose type is not a name of [A-Za-z0-9_.:/-], 1 to 100 bytes"
            );
            return Ok(());
        }
        match serde_json::from_str::<serde_json::Value>(&payload) {
            Ok(payload @ serde_json::Value::Object(_)) => self.emit(GuestEvent::Custom {
                event_type,
                payload,
            }),
            _ => {
                tracing::warn!(
                    component = %self.component,
                    event_type = %event_type,
                    "dropped an event whose payload is not a JSON object"
                );
                Ok(())
            }
        }
    }
}
