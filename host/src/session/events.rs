//! Live events of a running Step: guest events go to the session's Stream
//! through a per-Step buffer, flushed by a background task while the call
//! runs; what is left when it returns is committed with the Step's result.
//! The buffer is bounded ([`MAX_PENDING_BYTES`]), each flush writes at most
//! [`MAX_FLUSH_ENTRIES`] entries, and consecutive deltas merge into entries
//! of up to [`MAX_DELTA_ENTRY_BYTES`]. Events a Step commits with its result
//! (turn started, tool call finished, ...) are built with [`session_event`].

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::event_data::{
    EventData, GuestLog, ReasoningDelta, TextDelta, ToolCallFinished, ToolCallStarted,
};
use super::records::{event_type, AgentEvent, AGENT_EVENTS, ORIGIN_GUEST};
use crate::flow::{Heartbeat, Json, StepContext, StoreError};
use crate::plugin::{
    EventSink, GuestEvent, HeartbeatSink, StepTag, TaggedEvent, EVENT_ENVELOPE_BYTES,
};

/// How often the session heartbeats in the background while a Step runs.
pub const BACKGROUND_HEARTBEAT: Duration = Duration::from_secs(20);

/// The stream payload of an event of `tag`'s Step.
pub fn session_event(tag: &StepTag, event_type: &str, data: Json) -> Json {
    let event = AgentEvent {
        event_type: event_type.to_string(),
        turn_id: tag.turn_id.clone(),
        step_execution_id: tag.step_execution_id.clone(),
        attempt: tag.attempt,
        origin: None,
        data,
    };
    serde_json::to_value(event).unwrap_or(Json::Null)
}

/// Event types only the host writes; a guest's `write-event` may not use them,
/// so that no component can fake the session's own record of what happened
/// (or end a client's event stream).
pub(super) const RESERVED: [&str; 17] = [
    event_type::VERSION_CHANGED,
    event_type::SESSION_ENDED,
    event_type::GUEST_LOG,
    event_type::TURN_STARTED,
    event_type::TURN_CANCEL_REQUESTED,
    event_type::TURN_CANCELLED,
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
    event_type::HISTORY_COMPACTED,
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

/// The stream payload of an event a component wrote: the host's envelope,
/// marked with the guest's origin.
fn guest_payload(tag: &StepTag, kind: &str, data: Json) -> Json {
    let mut payload = session_event(tag, kind, data);
    if let Some(object) = payload.as_object_mut() {
        object.insert("origin".to_string(), json!(ORIGIN_GUEST));
    }
    payload
}

/// The stream payload of a guest's event; none for a reserved event type,
/// or for a tool event about a call the host itself runs (`managed`): the
/// host's `tool_call_started`/`tool_call_finished` come once per call, and
/// no guest may add to them.
fn guest_event(event: TaggedEvent, managed: &HashSet<String>) -> Option<Json> {
    if let GuestEvent::ToolCallStarted { tool_call_id, .. }
    | GuestEvent::ToolCallFinished { tool_call_id, .. } = &event.event
    {
        if managed.contains(tool_call_id) {
            tracing::warn!(
                tool_call_id,
                "a guest may not write tool events for a call the host runs; dropped"
            );
            return None;
        }
    }
    let (kind, data) = match event.event {
        GuestEvent::TextDelta { text } => typed(&TextDelta { text }),
        GuestEvent::ReasoningDelta { text } => typed(&ReasoningDelta { text }),
        GuestEvent::ToolCallStarted {
            tool_call_id,
            tool_name,
        } => typed(&ToolCallStarted {
            tool_call_id,
            tool_name,
        }),
        GuestEvent::ToolCallFinished {
            tool_call_id,
            tool_name,
            status,
        } => typed(&ToolCallFinished {
            tool_call_id,
            tool_name,
            status,
        }),
        GuestEvent::GuestLog {
            component,
            stream,
            text,
            dropped_bytes,
        } => typed(&GuestLog {
            component,
            stream,
            text,
            dropped_bytes,
        }),
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
    Some(guest_payload(&event.tag, &kind, data))
}

/// A guest event of one of the host's types, with that type's data.
fn typed<D: EventData>(data: &D) -> (String, Json) {
    (
        D::TYPE.to_string(),
        serde_json::to_value(data).unwrap_or(Json::Null),
    )
}

/// The longest text one merged delta entry holds: consecutive text (or
/// reasoning) deltas of a Step become entries of up to this size, so a long
/// answer streamed token by token is a few rows, not one per token.
pub const MAX_DELTA_ENTRY_BYTES: usize = 4 << 10;

/// What a Step's buffer holds before its flush; past it, events are dropped
/// with one warning (the writer is behind, and events are best effort).
pub const MAX_PENDING_BYTES: u64 = 1 << 20;

/// The most entries one live flush writes, so that one Step's burst never
/// holds the store's single writer for long.
pub const MAX_FLUSH_ENTRIES: usize = 64;

/// One pending stream entry.
enum Pending {
    /// Merged text or reasoning deltas of one Step.
    Delta {
        kind: &'static str,
        tag: StepTag,
        text: String,
    },
    Event(Json),
}

impl Pending {
    fn into_payload(self) -> Json {
        match self {
            Pending::Delta { kind, tag, text } => guest_payload(&tag, kind, json!({"text": text})),
            Pending::Event(payload) => payload,
        }
    }
}

#[derive(Default)]
struct Queue {
    /// Each entry with the stored bytes it was charged.
    entries: std::collections::VecDeque<(Pending, u64)>,
    /// Stored bytes of `entries`, as charged.
    bytes: u64,
    dropped: u64,
}

/// A delta's kind and text, if `event` is one.
fn delta(event: &GuestEvent) -> Option<(&'static str, &str)> {
    match event {
        GuestEvent::TextDelta { text } => Some((event_type::TEXT_DELTA, text)),
        GuestEvent::ReasoningDelta { text } => Some((event_type::REASONING_DELTA, text)),
        _ => None,
    }
}

impl Queue {
    /// The tail entry's text and charge, if `event` is a delta that extends
    /// it (to at most `max` bytes of text).
    fn merge_target(&mut self, event: &TaggedEvent, max: usize) -> Option<(&mut String, &mut u64)> {
        let (kind, text) = delta(&event.event)?;
        match self.entries.back_mut()? {
            (
                Pending::Delta {
                    kind: tail_kind,
                    tag,
                    text: tail,
                },
                charged,
            ) if *tail_kind == kind && *tag == event.tag && tail.len() + text.len() <= max => {
                Some((tail, charged))
            }
            _ => None,
        }
    }
}

#[derive(Default)]
struct Buffer {
    /// The event stream's capacity in bytes.
    capacity: u64,
    /// Tool call ids the host runs in this turn (see [`guest_event`]).
    managed: HashSet<String>,
    /// Whether a guest's tool events wait for the call's outcome (RunModel:
    /// a runner could otherwise announce a call it is about to defer).
    hold_tool_events: bool,
    /// Those held events, with their tool call ids, at most
    /// [`MAX_FLUSH_ENTRIES`] of them.
    held: Mutex<Vec<(String, Json)>>,
    pending: Mutex<Queue>,
    wake: Notify,
    closing: Notify,
    closed: AtomicBool,
}

/// Live events are written at most this often, so that a burst of small
/// deltas becomes one write, and an instant call's events ride in its commit.
pub const LIVE_FLUSH_INTERVAL: Duration = Duration::from_millis(10);

impl EventSink for Buffer {
    fn write(&self, event: TaggedEvent) {
        let Ok(mut queue) = self.pending.lock() else {
            return;
        };
        let cost = self.cost_in(&mut queue, &event);
        if queue.bytes.saturating_add(cost) > MAX_PENDING_BYTES {
            queue.dropped += 1;
            if queue.dropped == 1 {
                tracing::warn!(
                    flow_id = %event.tag.flow_id,
                    "live events are arriving faster than they are stored; dropping them"
                );
            }
            return;
        }
        if let Some((tail, charged)) = queue.merge_target(&event, self.max_delta()) {
            if let Some((_, text)) = delta(&event.event) {
                tail.push_str(text);
            }
            *charged += cost;
            queue.bytes += cost;
            return;
        }
        let entry = match delta(&event.event) {
            Some((kind, _)) => {
                let (GuestEvent::TextDelta { text } | GuestEvent::ReasoningDelta { text }) =
                    event.event
                else {
                    return;
                };
                if text.len() as u64 + EVENT_ENVELOPE_BYTES > self.capacity {
                    return;
                }
                Pending::Delta {
                    kind,
                    tag: event.tag,
                    text,
                }
            }
            None => {
                let held_id = match &event.event {
                    GuestEvent::ToolCallStarted { tool_call_id, .. }
                    | GuestEvent::ToolCallFinished { tool_call_id, .. }
                        if self.hold_tool_events =>
                    {
                        Some(tool_call_id.clone())
                    }
                    _ => None,
                };
                let Some(payload) =
                    guest_event(event, &self.managed).filter(|p| fits(p, self.capacity))
                else {
                    return;
                };
                if let Some(id) = held_id {
                    drop(queue);
                    self.hold(id, payload);
                    return;
                }
                Pending::Event(payload)
            }
        };
        queue.bytes += cost;
        queue.entries.push_back((entry, cost));
        drop(queue);
        self.wake.notify_one();
    }

    fn stored_cost(&self, event: &TaggedEvent) -> u64 {
        match self.pending.lock() {
            Ok(mut queue) => self.cost_in(&mut queue, event),
            Err(_) => event.event.stored_bytes() + EVENT_ENVELOPE_BYTES,
        }
    }
}

impl Buffer {
    fn hold(&self, tool_call_id: String, payload: Json) {
        if let Ok(mut held) = self.held.lock() {
            if held.len() < MAX_FLUSH_ENTRIES {
                held.push((tool_call_id, payload));
            } else if held.len() == MAX_FLUSH_ENTRIES {
                tracing::warn!("a runner wrote more tool events than are kept; dropping them");
            }
        }
    }

    /// The most text a merged delta entry holds: [`MAX_DELTA_ENTRY_BYTES`],
    /// or less on a stream too small for an entry that size.
    fn max_delta(&self) -> usize {
        let room = self.capacity.saturating_sub(2 * EVENT_ENVELOPE_BYTES);
        MAX_DELTA_ENTRY_BYTES.min(usize::try_from(room).unwrap_or(usize::MAX))
    }

    /// A delta that extends the tail entry costs its text; anything else
    /// is a new entry and costs its envelope too.
    fn cost_in(&self, queue: &mut Queue, event: &TaggedEvent) -> u64 {
        let bytes = event.event.stored_bytes();
        if queue.merge_target(event, self.max_delta()).is_some() {
            bytes
        } else {
            bytes + EVENT_ENVELOPE_BYTES
        }
    }

    /// Takes up to `max` entries, oldest first.
    fn take(&self, max: usize) -> Vec<Json> {
        let Ok(mut queue) = self.pending.lock() else {
            return Vec::new();
        };
        let count = queue.entries.len().min(max);
        let taken: Vec<(Pending, u64)> = queue.entries.drain(..count).collect();
        let freed: u64 = taken.iter().map(|(_, cost)| cost).sum();
        queue.bytes = queue.bytes.saturating_sub(freed);
        // A merged delta whose text grew in escaping past a small stream's
        // capacity is dropped here, not left to fail its whole batch.
        taken
            .into_iter()
            .map(|(entry, _)| entry.into_payload())
            .filter(|payload| fits(payload, self.capacity))
            .collect()
    }

    /// Whether entries are still waiting.
    fn has_pending(&self) -> bool {
        self.pending
            .lock()
            .map(|queue| !queue.entries.is_empty())
            .unwrap_or(false)
    }

    /// How many events were dropped because the buffer was full.
    fn dropped(&self) -> u64 {
        self.pending.lock().map(|queue| queue.dropped).unwrap_or(0)
    }
}

/// The event stream of one Step execution attempt.
pub(crate) struct StepEvents {
    buffer: Arc<Buffer>,
    drain: Option<JoinHandle<()>>,
    store: Arc<dyn crate::flow::FlowStore>,
    flow_id: String,
}

impl StepEvents {
    /// Starts the background flush into `ctx`'s session stream. `managed`:
    /// the tool call ids the host runs in this turn, for which a guest's
    /// tool events are refused.
    pub fn start(ctx: &StepContext, capacity: u64, managed: HashSet<String>) -> Self {
        Self::start_with(ctx, capacity, managed, false)
    }

    /// As [`Self::start`], but a guest's tool events are held until
    /// [`Self::finish_refusing`] knows which calls the outcome defers.
    pub fn start_holding_tool_events(
        ctx: &StepContext,
        capacity: u64,
        managed: HashSet<String>,
    ) -> Self {
        Self::start_with(ctx, capacity, managed, true)
    }

    fn start_with(
        ctx: &StepContext,
        capacity: u64,
        managed: HashSet<String>,
        hold_tool_events: bool,
    ) -> Self {
        let buffer = Arc::new(Buffer {
            capacity,
            managed,
            hold_tool_events,
            ..Buffer::default()
        });
        let (store, flow_id) = (ctx.store().clone(), ctx.flow_id().to_string());
        let drained = buffer.clone();
        let drain = tokio::spawn({
            let (store, flow_id) = (store.clone(), flow_id.clone());
            async move {
                loop {
                    // Once closed, what is left goes into the Step's commit.
                    if drained.closed.load(Ordering::Acquire) {
                        break;
                    }
                    let batch = drained.take(MAX_FLUSH_ENTRIES);
                    if !batch.is_empty() {
                        // Events are best effort; a reader rebuilds from the snapshot.
                        match store.append_stream(&flow_id, AGENT_EVENTS, batch).await {
                            Ok(_) => {}
                            // Stopped, failed or completed under this Step:
                            // nothing more is taken, so stop trying.
                            Err(StoreError::FlowEnded { .. }) => {
                                tracing::debug!(
                                    flow_id,
                                    "the session has ended; its live events are dropped"
                                );
                                break;
                            }
                            Err(err) => {
                                tracing::warn!(flow_id, error = %err, "dropping live events")
                            }
                        }
                    }
                    // A bounded flush may leave entries behind: flush again
                    // after the interval without waiting for a new event.
                    if !drained.has_pending() {
                        drained.wake.notified().await;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(LIVE_FLUSH_INTERVAL) => {}
                        _ = drained.closing.notified() => {}
                    }
                }
            }
        });
        Self {
            buffer,
            drain: Some(drain),
            store,
            flow_id,
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

    /// [`Self::finish`], then the held tool events (after the Step's other
    /// events, at most [`MAX_FLUSH_ENTRIES`] more), less those about a call
    /// in `refused` (the calls the outcome defers, which the host runs).
    pub async fn finish_refusing(self, refused: &HashSet<String>) -> Vec<Json> {
        let held = self
            .buffer
            .held
            .lock()
            .map(|mut held| std::mem::take(&mut *held))
            .unwrap_or_default();
        let mut leftovers = self.finish().await;
        for (id, payload) in held {
            if refused.contains(&id) {
                tracing::warn!(
                    tool_call_id = %id,
                    "a runner wrote tool events for a call it defers to the host; dropped"
                );
            } else {
                leftovers.push(payload);
            }
        }
        leftovers
    }

    /// Stops the background flush and returns the events it had not written
    /// yet, in order, for the Step to commit with its result (at most
    /// [`MAX_FLUSH_ENTRIES`] of them; an older backlog is written first).
    pub async fn finish(mut self) -> Vec<Json> {
        self.close();
        if let Some(drain) = self.drain.take() {
            if let Err(err) = drain.await {
                tracing::warn!(error = %err, "the event flush task failed");
            }
        }
        let dropped = self.buffer.dropped();
        if dropped > 0 {
            tracing::warn!(dropped, "live events dropped while the buffer was full");
        }
        // The Step's commit takes at most one flush's worth; a larger
        // backlog goes first, in bounded writes, so that no single write
        // holds the store's writer for long. Order is kept.
        loop {
            let batch = self.buffer.take(MAX_FLUSH_ENTRIES);
            if !self.buffer.has_pending() {
                return batch;
            }
            match self
                .store
                .append_stream(&self.flow_id, AGENT_EVENTS, batch)
                .await
            {
                Ok(_) => {}
                Err(StoreError::FlowEnded { .. }) => {
                    tracing::debug!(flow_id = %self.flow_id, "the session has ended; its live events are dropped");
                    return Vec::new();
                }
                Err(err) => {
                    tracing::warn!(flow_id = %self.flow_id, error = %err, "dropping live events")
                }
            }
        }
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
    fn a_payload_as_deep_as_write_event_accepts_is_stored_readably() {
        use crate::plugin::factors::events::{check_payload_shape, MAX_EVENT_PAYLOAD_DEPTH};
        let depth = MAX_EVENT_PAYLOAD_DEPTH;
        let text = format!(
            "{}{{}}{}",
            "{\"a\":".repeat(depth - 1),
            "}".repeat(depth - 1)
        );
        assert_eq!(check_payload_shape(&text), Ok(()));
        let mut event = custom("deep");
        event.event = GuestEvent::Custom {
            event_type: "deep".into(),
            payload: serde_json::from_str(&text).expect("parses"),
        };
        let stored = guest_event(event, &HashSet::new())
            .expect("stored")
            .to_string();
        // What the store and every reader parse back (serde_json's default
        // recursion limit), with room to spare for one more wrapping.
        let wrapped = format!("{{\"page\":[{stored}]}}");
        let read: Json = serde_json::from_str(&wrapped).expect("readable back");
        assert_eq!(read["page"][0]["type"], "deep");
    }

    #[test]
    fn a_guest_cannot_write_the_hosts_own_event_types() {
        for reserved in RESERVED {
            assert_eq!(
                guest_event(custom(reserved), &HashSet::new()),
                None,
                "{reserved}"
            );
        }
        let allowed = guest_event(custom("progress"), &HashSet::new()).expect("a custom event");
        assert_eq!(allowed["origin"], json!(ORIGIN_GUEST));
        assert_eq!(allowed["type"], json!("progress"));
        assert_eq!(allowed["step_execution_id"], json!("sx-1"));
    }

    fn tag() -> StepTag {
        custom("x").tag
    }

    fn buffer() -> Arc<Buffer> {
        Arc::new(Buffer {
            capacity: 10 << 20,
            ..Buffer::default()
        })
    }

    #[test]
    fn ten_thousand_deltas_are_stored_as_a_few_bounded_entries() {
        let buffer = buffer();
        let writer = crate::plugin::EventWriter::new(tag(), buffer.clone(), 1 << 20);
        for n in 0..10_000 {
            let text = format!("t{:03} ", n % 1000);
            writer
                .write(GuestEvent::TextDelta { text })
                .expect("within budget");
        }
        let rows = buffer.take(usize::MAX);
        let texts: Vec<&str> = rows
            .iter()
            .map(|r| r["data"]["text"].as_str().unwrap_or(""))
            .collect();
        let expected: String = (0..10_000).map(|n| format!("t{:03} ", n % 1000)).collect();
        assert_eq!(texts.concat(), expected, "merged in order, nothing lost");
        assert!(texts.iter().all(|t| t.len() <= MAX_DELTA_ENTRY_BYTES));
        assert_eq!(rows.len(), expected.len().div_ceil(MAX_DELTA_ENTRY_BYTES));
        assert!(rows
            .iter()
            .all(|r| r["type"] == json!(event_type::TEXT_DELTA)));
    }

    #[test]
    fn deltas_of_another_kind_start_a_new_entry_and_pay_its_envelope() {
        let buffer = buffer();
        let writer = crate::plugin::EventWriter::new(tag(), buffer.clone(), 1 << 20);
        for _ in 0..100 {
            writer
                .write(GuestEvent::TextDelta { text: "a".into() })
                .expect("text");
            writer
                .write(GuestEvent::ReasoningDelta { text: "b".into() })
                .expect("reasoning");
        }
        assert_eq!(buffer.take(usize::MAX).len(), 200);
        assert_eq!(writer.bytes_written(), 200 * (1 + EVENT_ENVELOPE_BYTES));
    }

    #[test]
    fn the_buffer_holds_at_most_its_bound_and_a_flush_takes_at_most_its_batch() {
        let buffer = buffer();
        let big = json!({"pad": "p".repeat(1000)});
        for _ in 0..10_000 {
            let mut event = custom("progress");
            event.event = GuestEvent::Custom {
                event_type: "progress".into(),
                payload: big.clone(),
            };
            buffer.write(event);
        }
        let held = buffer.pending.lock().map(|q| q.bytes).unwrap_or(u64::MAX);
        assert!(held <= MAX_PENDING_BYTES, "{held}");
        assert!(buffer.dropped() > 0);
        assert_eq!(buffer.take(MAX_FLUSH_ENTRIES).len(), MAX_FLUSH_ENTRIES);
        let held_after = buffer.pending.lock().map(|q| q.bytes).unwrap_or(u64::MAX);
        assert!(held_after < held, "a flush frees what it took");
    }

    #[test]
    fn a_guest_cannot_write_tool_events_for_a_call_the_host_runs() {
        let managed: HashSet<String> = ["c1".to_string()].into();
        let forged = |id: &str| {
            let mut event = custom("x");
            event.event = GuestEvent::ToolCallFinished {
                tool_call_id: id.to_string(),
                tool_name: "pay".into(),
                status: "succeeded".into(),
            };
            event
        };
        assert_eq!(guest_event(forged("c1"), &managed), None);
        let own = guest_event(forged("inner-1"), &managed).expect("a framework's own call");
        assert_eq!(own["origin"], json!(ORIGIN_GUEST), "marked as the guest's");
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
