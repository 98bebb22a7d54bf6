//! `dex:agents/step`: heartbeats of the running Step.

use std::sync::Arc;

use crate::plugin::bindings::runner::dex::agents::step;
use crate::plugin::call::CallState;

/// The Step a call belongs to. The host tags every heartbeat and event with it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct StepTag {
    pub flow_id: String,
    pub turn_id: String,
    /// Shared by every attempt of one Step execution.
    pub step_execution_id: String,
    /// One-based.
    pub attempt: u32,
}

/// Receives the heartbeats a guest sends.
pub trait HeartbeatSink: Send + Sync {
    fn heartbeat(&self, tag: &StepTag);
}

/// Drops heartbeats; for calls that belong to no Step (such as `list-tools`).
pub struct NoHeartbeats;

impl HeartbeatSink for NoHeartbeats {
    fn heartbeat(&self, _tag: &StepTag) {}
}

pub(crate) struct StepState {
    pub tag: StepTag,
    pub sink: Arc<dyn HeartbeatSink>,
}

impl step::Host for CallState {
    fn heartbeat(&mut self) -> wasmtime::Result<()> {
        self.step.sink.heartbeat(&self.step.tag);
        Ok(())
    }
}
