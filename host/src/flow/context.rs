//! What a Step handler sees while it runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::de::DeserializeOwned;

use super::registry::StepError;
use super::store::{FlowStore, StateAnswer, StateQuery};
use super::types::{ChannelMessage, ClaimedTask, Json, MapQuery, StoreMillis, Versioned};
use crate::telemetry::traces::SpanParent;

/// Work to do once the attempt's result has committed (and never if it
/// does not).
pub type OnCommit = Box<dyn FnOnce() + Send>;

/// Where the attempt's span is reported, and what it adds.
#[derive(Default)]
pub(crate) struct AttemptTrace {
    /// The span the attempt's span is a child of; None: a trace of its own.
    pub(crate) parent: Option<SpanParent>,
    /// Attributes beyond the engine's own (the handler's: a turn, say).
    pub(crate) attributes: Vec<opentelemetry::KeyValue>,
    /// The flow's own trace said not to record: no span is reported.
    pub(crate) unsampled: bool,
    pub(crate) on_commit: Vec<OnCommit>,
}

/// Liveness of one running Step. Cheap to clone; `beat` is synchronous so that
/// host imports can call it.
#[derive(Clone)]
pub struct Heartbeat {
    inner: Arc<HeartbeatInner>,
}

struct HeartbeatInner {
    last_beat: Mutex<Instant>,
    /// Set by `beat`; the worker records output durably and clears it.
    unrecorded: AtomicBool,
}

impl Heartbeat {
    pub(crate) fn new() -> Self {
        Self {
            inner: Arc::new(HeartbeatInner {
                last_beat: Mutex::new(Instant::now()),
                unrecorded: AtomicBool::new(false),
            }),
        }
    }

    /// Records liveness. The worker persists it with its next lease renewal.
    pub fn beat(&self) {
        if let Ok(mut last) = self.inner.last_beat.lock() {
            *last = Instant::now();
        }
        self.inner.unrecorded.store(true, Ordering::Release);
    }

    pub(crate) fn last_beat(&self) -> Instant {
        self.inner
            .last_beat
            .lock()
            .map(|last| *last)
            .unwrap_or_else(|_| Instant::now())
    }

    /// Puts back a beat whose record failed, for the next renewal round.
    pub(crate) fn mark_unrecorded(&self) {
        self.inner.unrecorded.store(true, Ordering::Release);
    }

    pub(crate) fn take_unrecorded(&self) -> bool {
        self.inner.unrecorded.swap(false, Ordering::AcqRel)
    }
}

/// The running Step: its task, read access to committed state, heartbeats.
#[derive(Clone)]
pub struct StepContext {
    task: Arc<ClaimedTask>,
    store: Arc<dyn FlowStore>,
    heartbeat: Heartbeat,
    /// The version of the component the attempt ran, for its history entry.
    component: Arc<Mutex<Option<String>>>,
    trace: Arc<Mutex<AttemptTrace>>,
}

impl StepContext {
    pub(crate) fn new(
        task: Arc<ClaimedTask>,
        store: Arc<dyn FlowStore>,
        heartbeat: Heartbeat,
    ) -> Self {
        Self {
            task,
            store,
            heartbeat,
            component: Arc::new(Mutex::new(None)),
            trace: Arc::new(Mutex::new(AttemptTrace::default())),
        }
    }

    /// Reports this attempt's span under `parent` (a span of the flow's
    /// own, such as a turn's, perhaps in another process), with
    /// `attributes` besides the engine's.
    pub fn trace_under(&self, parent: SpanParent, attributes: Vec<opentelemetry::KeyValue>) {
        if let Ok(mut trace) = self.trace.lock() {
            trace.parent = Some(parent);
            trace.attributes = attributes;
        }
    }

    /// Reports no span for this attempt: it belongs to a trace its sender
    /// asked not to record.
    pub fn trace_unsampled(&self) {
        if let Ok(mut trace) = self.trace.lock() {
            trace.unsampled = true;
        }
    }

    /// Runs `then` after this attempt's result commits, never if it does
    /// not (for reports that must not repeat with a retried attempt).
    pub fn on_commit(&self, then: impl FnOnce() + Send + 'static) {
        if let Ok(mut trace) = self.trace.lock() {
            trace.on_commit.push(Box::new(then));
        }
    }

    /// What [`Self::trace_under`] and [`Self::on_commit`] recorded.
    pub(crate) fn take_trace(&self) -> AttemptTrace {
        self.trace
            .lock()
            .map(|mut trace| std::mem::take(&mut *trace))
            .unwrap_or_default()
    }

    /// Says which component version (digest) this attempt runs: its history
    /// entry records it, whether the attempt commits or fails.
    pub fn record_component(&self, digest: &str) {
        if let Ok(mut ran) = self.component.lock() {
            *ran = Some(digest.to_string());
        }
    }

    /// What [`StepContext::record_component`] recorded.
    pub fn component(&self) -> Option<String> {
        self.component.lock().ok().and_then(|ran| ran.clone())
    }

    pub fn task(&self) -> &ClaimedTask {
        &self.task
    }

    pub fn flow_id(&self) -> &str {
        &self.task.flow_id
    }

    pub fn input(&self) -> &Json {
        &self.task.input
    }

    pub fn attempt(&self) -> u32 {
        self.task.attempt
    }

    pub fn step_execution_id(&self) -> &str {
        &self.task.step_execution_id
    }

    /// The messages that satisfied the Step's wait; consumed when it commits.
    pub fn messages(&self) -> &[ChannelMessage] {
        &self.task.messages
    }

    /// Whether the wait's timer was due when the Step was claimed.
    pub fn timer_fired(&self) -> bool {
        self.task.timer_fired
    }

    /// For a failure-route Step: why the failed Step failed.
    pub fn failure(&self) -> Option<&str> {
        self.task.failure.as_deref()
    }

    pub fn store(&self) -> &Arc<dyn FlowStore> {
        &self.store
    }

    /// The store's clock.
    pub async fn now(&self) -> Result<StoreMillis, StepError> {
        Ok(self.store.now().await?)
    }

    /// A handle for synchronous heartbeats (host imports, callbacks).
    pub fn heartbeat_handle(&self) -> Heartbeat {
        self.heartbeat.clone()
    }

    /// Records liveness and waits until the store has recorded that this
    /// attempt produced output: after this, a lost worker means the next
    /// attempt, not a redelivery of this one.
    pub async fn heartbeat(&self) -> Result<(), StepError> {
        self.heartbeat.beat();
        self.heartbeat.take_unrecorded();
        self.store
            .record_output(self.task.task_id, self.task.lease_token)
            .await?;
        Ok(())
    }

    /// Records output (as [`StepContext::heartbeat`]) and appends live events,
    /// in one write.
    pub async fn heartbeat_with_events(
        &self,
        stream: &str,
        payloads: Vec<Json>,
    ) -> Result<(), StepError> {
        self.heartbeat.beat();
        self.heartbeat.take_unrecorded();
        self.store
            .record_output_and_append(
                self.task.task_id,
                self.task.lease_token,
                &self.task.flow_id,
                stream,
                payloads,
            )
            .await?;
        Ok(())
    }

    /// Several reads from one consistent snapshot, in one round trip.
    pub async fn read_state(
        &self,
        queries: Vec<StateQuery>,
    ) -> Result<Vec<StateAnswer>, StepError> {
        Ok(self.store.read_state(&self.task.flow_id, queries).await?)
    }

    pub async fn get(&self, name: &str, key: &str) -> Result<Option<Versioned>, StepError> {
        Ok(self.store.get(&self.task.flow_id, name, key).await?)
    }

    /// Reads and decodes an Attribute or map entry.
    pub async fn get_value<T: DeserializeOwned>(
        &self,
        name: &str,
        key: &str,
    ) -> Result<Option<T>, StepError> {
        match self.get(name, key).await? {
            None => Ok(None),
            Some(versioned) => serde_json::from_value(versioned.value)
                .map(Some)
                .map_err(|err| {
                    StepError::fatal(format!("stored {name}/{key} is unreadable: {err}"))
                }),
        }
    }

    pub async fn read_map(
        &self,
        name: &str,
        query: MapQuery,
    ) -> Result<Vec<(String, Versioned)>, StepError> {
        Ok(self.store.read_map(&self.task.flow_id, name, query).await?)
    }

    /// Appends to a stream now, outside the Step's commit (live events).
    pub async fn append_stream(&self, stream: &str, payloads: Vec<Json>) -> Result<(), StepError> {
        self.store
            .append_stream(&self.task.flow_id, stream, payloads)
            .await?;
        Ok(())
    }
}
