//! Live events of a running Step: guest events go to the session's Stream
//! through a per-Step buffer, flushed by a background task while the call
//! runs; what is left when it returns is committed with the Step's result. Events a Step commits with its result (turn
//! started, tool call finished, ...) are built with [`session_event`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::records::{event_type, AgentEvent, AGENT_EVENTS};
use crate::flow::{Heartbeat, Json, StepContext};
use crate::plugin::{EventSink, GuestEvent, HeartbeatSink, StepTag, TaggedEvent};

/// How often the session heartbeats in the background while a Step runs.
pub const BACKGROUND_HEARTBEAT: Duration = Duration::from_secs(20);

/// The stream payload of an event of `tag`'s Step.
pub fn session_event(tag: &StepTag, event_type: &str, data: Json) -> Json {
    let event = AgentEvent {
        event_type: event_type.to_string(),
        turn_id: tag.turn_id.clone(),
        step_execution_id: tag.step_execution_id.clone(),
        attempt: tag.attempt,
        data,
    };
    serde_json::to_value(event).unwrap_or(Json::Null)
}

/// Event types only the host writes; a guest's `write-event` may not use them,
/// so that no component can fake the session's own record of what happened.
const RESERVED: [&str; 11] = [
    event_type::TURN_STARTED,
    event_type::TOOL_CALL_STARTED,
    event_type::TOOL_CALL_FINISHED,
    event_type::TURN_COMPLETED,
    event_type::TURN_FAILED,
    event_type::TEXT_DELTA,
    event_type::REASONING_DELTA,
    event_type::TOOL_CALL_DEFERRED,
    event_type::INTERRUPT_RAISED,
    event_type::INTERRUPT_RESOLVED,
    event_type::USAGE_RECORDED,
];

/// Whether an event fits the stream: one larger than the stream's capacity
/// could never be stored, and events are best effort, so it is dropped.
pub fn fits(payload: &Json, capacity: u64) -> bool {
    let size = serde_json::to_string(payload)
        .map(|t| t.len() as u64)
        .unwrap_or(u64::MAX);
    if size > capacity {
        tracing::warn!(
            size,
            capacity,
            "dropping an event larger than the event stream's capacity"
        );
        return false;
    }
    true
}

/// The stream payload of a guest's event; none for a reserved event type.
fn guest_event(event: TaggedEvent) -> Option<Json> {
    let (kind, data) = match event.event {
        GuestEvent::TextDelta { text } => {
            (event_type::TEXT_DELTA.to_string(), json!({"text": text}))
        }
        GuestEvent::ReasoningDelta { text } => (
            event_type::REASONING_DELTA.to_string(),
            json!({"text": text}),
        ),
        GuestEvent::ToolCallStarted {
            tool_call_id,
            tool_name,
        } => (
            event_type::TOOL_CALL_STARTED.to_string(),
            json!({"tool_call_id": tool_call_id, "tool_name": tool_name}),
        ),
        GuestEvent::ToolCallFinished {
            tool_call_id,
            tool_name,
            status,
        } => (
            event_type::TOOL_CALL_FINISHED.to_string(),
            json!({"tool_call_id": tool_call_id, "tool_name": tool_name, "status": status}),
        ),
        GuestEvent::Custom {
            event_type,
            payload,
        } => {
            if RESERVED.contains(&event_type.as_str()) {
                tracing::warn!(
                    event_type,
                    "a guest may not write the host's own event types"
                );
                return None;
            }
            (event_type, payload)
        }
    };
    Some(session_event(&event.tag, &kind, data))
}

#[derive(Default)]
struct Buffer {
    /// The event stream's capacity in bytes.
    capacity: u64,
    pending: Mutex<Vec<Json>>,
    wake: Notify,
    closing: Notify,
    closed: AtomicBool,
}

/// Live events are written at most this often, so that a burst of small
/// deltas becomes one write, and an instant call's events ride in its commit.
pub const LIVE_FLUSH_INTERVAL: Duration = Duration::from_millis(10);

impl EventSink for Buffer {
    fn write(&self, event: TaggedEvent) {
        let Some(payload) = guest_event(event).filter(|p| fits(p, self.capacity)) else {
            return;
        };
        if let Ok(mut pending) = self.pending.lock() {
            pending.push(payload);
        }
        self.wake.notify_one();
    }
}

impl Buffer {
    fn take(&self) -> Vec<Json> {
        self.pending
            .lock()
            .map(|mut pending| std::mem::take(&mut *pending))
            .unwrap_or_default()
    }
}

/// The event stream of one Step execution attempt.
pub(crate) struct StepEvents {
    buffer: Arc<Buffer>,
    drain: Option<JoinHandle<()>>,
}

impl StepEvents {
    /// Starts the background flush into `ctx`'s session stream.
    pub fn start(ctx: &StepContext, capacity: u64) -> Self {
        let buffer = Arc::new(Buffer {
            capacity,
            ..Buffer::default()
        });
        let store = ctx.store().clone();
        let flow_id = ctx.flow_id().to_string();
        let drained = buffer.clone();
        let drain = tokio::spawn(async move {
            loop {
                // Once closed, what is left goes into the Step's commit.
                if drained.closed.load(Ordering::Acquire) {
                    break;
                }
                let batch = drained.take();
                if !batch.is_empty() {
                    // Events are best effort; a reader rebuilds from the snapshot.
                    if let Err(err) = store.append_stream(&flow_id, AGENT_EVENTS, batch).await {
                        tracing::warn!(flow_id, error = %err, "dropping live events");
                    }
                }
                drained.wake.notified().await;
                tokio::select! {
                    _ = tokio::time::sleep(LIVE_FLUSH_INTERVAL) => {}
                    _ = drained.closing.notified() => {}
                }
            }
        });
        Self {
            buffer,
            drain: Some(drain),
        }
    }

    fn close(&self) {
        self.buffer.closed.store(true, Ordering::Release);
        self.buffer.wake.notify_one();
        self.buffer.closing.notify_one();
    }

    pub fn sink(&self) -> Arc<dyn EventSink> {
        self.buffer.clone()
    }

    /// Stops the background flush and returns the events it had not written
    /// yet, in order, for the Step to commit with its result.
    pub async fn finish(mut self) -> Vec<Json> {
        self.close();
        if let Some(drain) = self.drain.take() {
            if let Err(err) = drain.await {
                tracing::warn!(error = %err, "the event flush task failed");
            }
        }
        self.buffer.take()
    }
}

/// A Step aborted mid-call (timeout, lost lease) never calls `finish`; its
/// flush task must still end.
impl Drop for StepEvents {
    fn drop(&mut self) {
        if self.drain.is_some() {
            self.close();
        }
    }
}

/// Guest heartbeats, recorded on the running Step.
pub(crate) struct StepHeartbeats(pub Heartbeat);

impl HeartbeatSink for StepHeartbeats {
    fn heartbeat(&self, _tag: &StepTag) {
        self.0.beat();
    }
}

/// Beats every [`BACKGROUND_HEARTBEAT`] until dropped.
pub(crate) struct BackgroundHeartbeat(JoinHandle<()>);

impl BackgroundHeartbeat {
    pub fn start(heartbeat: Heartbeat) -> Self {
        Self(tokio::spawn(async move {
            loop {
                tokio::time::sleep(BACKGROUND_HEARTBEAT).await;
                heartbeat.beat();
            }
        }))
    }
}

impl Drop for BackgroundHeartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn custom(event_type: &str) -> TaggedEvent {
        TaggedEvent {
            tag: StepTag {
                flow_id: "s".into(),
                turn_id: "turn-1".into(),
                step_execution_id: "sx-1".into(),
                attempt: 1,
            },
            event: GuestEvent::Custom {
                event_type: event_type.to_string(),
                payload: json!({"n": 1}),
            },
        }
    }

    #[test]
    fn a_guest_cannot_write_the_hosts_own_event_types() {
        for reserved in RESERVED {
            assert_eq!(guest_event(custom(reserved)), None, "{reserved}");
        }
        let allowed = guest_event(custom("progress")).expect("a custom event");
        assert_eq!(allowed["type"], json!("progress"));
        assert_eq!(allowed["step_execution_id"], json!("sx-1"));
    }

    #[test]
    fn an_event_larger_than_the_stream_is_dropped() {
        let event = json!({"text": "x".repeat(100)});
        assert!(fits(&event, 1000));
        assert!(!fits(&event, 50));
    }

    #[tokio::test(start_paused = true)]
    async fn the_background_heartbeat_beats_every_20_seconds_until_dropped() {
        let heartbeat = Heartbeat::new();
        heartbeat.take_unrecorded();
        let background = BackgroundHeartbeat::start(heartbeat.clone());
        tokio::time::sleep(BACKGROUND_HEARTBEAT - Duration::from_secs(1)).await;
        assert!(!heartbeat.take_unrecorded(), "no beat before 20 s");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(heartbeat.take_unrecorded(), "a beat at 20 s");
        tokio::time::sleep(BACKGROUND_HEARTBEAT).await;
        assert!(heartbeat.take_unrecorded(), "and every 20 s after");
        drop(background);
        tokio::time::sleep(BACKGROUND_HEARTBEAT * 2).await;
        assert!(!heartbeat.take_unrecorded(), "none once the Step has ended");
    }
}
