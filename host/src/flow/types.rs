//! Domain types of the Flow engine: what a Step is, how it ends, what it
//! writes, and what the store keeps about it.

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// JSON, the engine's value type for inputs, state and messages.
pub type Json = serde_json::Value;

/// Milliseconds since the Unix epoch, on the store's clock.
pub type StoreMillis = i64;

/// How often a Step is tried and how long each try may take.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Attempts in all, at least 1.
    pub max_attempts: u32,
    /// Every attempt must start within this time of the first one.
    #[serde(with = "opt_millis", default)]
    pub window: Option<Duration>,
    /// One attempt may run this long.
    #[serde(with = "opt_millis", default)]
    pub attempt_timeout: Option<Duration>,
    /// The Step must call `heartbeat` at least this often.
    #[serde(with = "opt_millis", default)]
    pub heartbeat_timeout: Option<Duration>,
    /// Pause before the second attempt; it doubles for each further attempt,
    /// up to 30 s.
    #[serde(with = "millis")]
    pub backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            window: None,
            attempt_timeout: Some(Duration::from_secs(5 * 60)),
            heartbeat_timeout: None,
            backoff: Duration::from_millis(100),
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retry.
    pub fn single_attempt() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    pub fn attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    pub fn window(mut self, window: Duration) -> Self {
        self.window = Some(window);
        self
    }

    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    pub fn heartbeat_timeout(mut self, timeout: Duration) -> Self {
        self.heartbeat_timeout = Some(timeout);
        self
    }

    pub fn backoff(mut self, backoff: Duration) -> Self {
        self.backoff = backoff;
        self
    }

    /// The pause before `attempt` (2 or more).
    pub fn backoff_before(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(2).min(16);
        self.backoff
            .saturating_mul(1 << doublings)
            .min(Duration::from_secs(30))
    }
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(value.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

mod opt_millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => s.serialize_some(&(d.as_millis() as u64)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

/// A channel condition: at least `count` messages on (`channel`, `key`).
/// A plain Channel uses the empty key; a ChannelMap one key per entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelWait {
    pub channel: String,
    pub key: String,
    pub count: u32,
}

impl ChannelWait {
    /// One message on a Channel.
    pub fn for_one(channel: impl Into<String>) -> Self {
        Self::for_n(channel, 1)
    }

    /// `count` messages on a Channel.
    pub fn for_n(channel: impl Into<String>, count: u32) -> Self {
        Self {
            channel: channel.into(),
            key: String::new(),
            count: count.max(1),
        }
    }

    /// One message under `key` of a ChannelMap.
    pub fn for_key(channel: impl Into<String>, key: impl Into<String>) -> Self {
        Self {
            channel: channel.into(),
            key: key.into(),
            count: 1,
        }
    }
}

/// What a waiting Step waits for: a channel condition, a timer, or either.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitSpec {
    pub channel: Option<ChannelWait>,
    /// Wake at this time even if the channel condition does not hold.
    pub timer_at: Option<StoreMillis>,
}

/// The next Step to run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepCall {
    pub step_type: String,
    pub input: Json,
    pub wait: Option<WaitSpec>,
}

impl StepCall {
    pub fn new(step_type: impl Into<String>, input: Json) -> Self {
        Self {
            step_type: step_type.into(),
            input,
            wait: None,
        }
    }

    /// Runs only once the channel condition holds; its messages are consumed
    /// when the Step commits.
    pub fn wait_for(mut self, condition: ChannelWait) -> Self {
        self.wait.get_or_insert_with(WaitSpec::default).channel = Some(condition);
        self
    }

    /// Runs at `at` (on the store's clock) if nothing else woke it first.
    pub fn wake_at(mut self, at: StoreMillis) -> Self {
        self.wait.get_or_insert_with(WaitSpec::default).timer_at = Some(at);
        self
    }
}

/// How a Step ends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StepOutcome {
    /// Run these Steps next (one is `go_to`, several is `go_to_many`; a Step
    /// with a wait is a wait).
    Next(Vec<StepCall>),
    /// This branch ends; the flow completes when no branch is left.
    End,
    /// The flow completes now; other branches are dropped.
    Complete,
}

/// A state change, committed with the Step's result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StateWrite {
    /// Sets an Attribute (empty key) or one key of an AttributeMap.
    Set {
        name: String,
        key: String,
        value: Json,
    },
    /// Deletes an Attribute or one key of an AttributeMap.
    Delete { name: String, key: String },
    /// Deletes every key of an AttributeMap.
    Clear { name: String },
    /// Publishes to a Channel (empty key) or one key of a ChannelMap.
    Publish {
        channel: String,
        key: String,
        payload: Json,
    },
    /// Appends to a Stream.
    Append { stream: String, payload: Json },
}

/// What a Step handler returns: its writes and how it ends, committed together.
#[derive(Clone, Debug, PartialEq)]
pub struct StepResult {
    pub writes: Vec<StateWrite>,
    pub outcome: StepOutcome,
}

impl StepResult {
    pub fn go_to(next: StepCall) -> Self {
        Self::go_to_many(vec![next])
    }

    pub fn go_to_many(next: Vec<StepCall>) -> Self {
        Self {
            writes: Vec::new(),
            outcome: StepOutcome::Next(next),
        }
    }

    pub fn end() -> Self {
        Self {
            writes: Vec::new(),
            outcome: StepOutcome::End,
        }
    }

    pub fn complete() -> Self {
        Self {
            writes: Vec::new(),
            outcome: StepOutcome::Complete,
        }
    }

    pub fn set(mut self, name: &str, value: Json) -> Self {
        self.writes.push(StateWrite::Set {
            name: name.to_string(),
            key: String::new(),
            value,
        });
        self
    }

    pub fn set_entry(mut self, name: &str, key: &str, value: Json) -> Self {
        self.writes.push(StateWrite::Set {
            name: name.to_string(),
            key: key.to_string(),
            value,
        });
        self
    }

    pub fn delete(mut self, name: &str, key: &str) -> Self {
        self.writes.push(StateWrite::Delete {
            name: name.to_string(),
            key: key.to_string(),
        });
        self
    }

    pub fn clear(mut self, name: &str) -> Self {
        self.writes.push(StateWrite::Clear {
            name: name.to_string(),
        });
        self
    }

    pub fn publish(mut self, channel: &str, key: &str, payload: Json) -> Self {
        self.writes.push(StateWrite::Publish {
            channel: channel.to_string(),
            key: key.to_string(),
            payload,
        });
        self
    }

    pub fn append(mut self, stream: &str, payload: Json) -> Self {
        self.writes.push(StateWrite::Append {
            stream: stream.to_string(),
            payload,
        });
        self
    }

    pub fn with_writes(mut self, writes: impl IntoIterator<Item = StateWrite>) -> Self {
        self.writes.extend(writes);
        self
    }
}

/// A Step task about to be stored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NewTask {
    pub step_type: String,
    pub input: Json,
    pub wait: Option<WaitSpec>,
    pub policy: RetryPolicy,
    pub failure_route: Option<String>,
    /// For a failure-route Step: why the failed Step failed.
    pub failure: Option<String>,
    /// Attribute names the Step holds while it runs; an RPC that locks one of
    /// them meanwhile gets a lock conflict.
    pub locks: Vec<String>,
    pub not_before: StoreMillis,
}

/// A task an RPC took from its flow ([`crate::flow::StateTx::take_tasks`]):
/// what it was when it was dropped.
#[derive(Clone, Debug, PartialEq)]
pub struct TakenTask {
    pub step_type: String,
    pub input: Json,
    /// A worker held it: its Step was running (and its commit is now
    /// refused).
    pub leased: bool,
    /// The running attempt had recorded output (a heartbeat, a started
    /// marker): it may have acted.
    pub output_recorded: bool,
    pub attempt: u32,
    /// For a failure-route task: why the failed Step failed.
    pub failure: Option<String>,
}

/// A message taken from a channel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChannelMessage {
    pub message_id: i64,
    pub channel: String,
    pub key: String,
    pub payload: Json,
}

/// A task a worker holds under a lease.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimedTask {
    pub task_id: i64,
    pub flow_id: String,
    pub flow_type: String,
    pub step_type: String,
    pub input: Json,
    /// Shared by every attempt of this Step execution.
    pub step_execution_id: String,
    /// One-based.
    pub attempt: u32,
    /// The fencing token: a commit with an older token is refused.
    pub lease_token: i64,
    pub policy: RetryPolicy,
    pub failure_route: Option<String>,
    pub failure: Option<String>,
    pub locks: Vec<String>,
    /// The messages that satisfied the wait, oldest first.
    pub messages: Vec<ChannelMessage>,
    /// Whether the timer of the wait was due when the task was claimed.
    pub timer_fired: bool,
    pub first_attempt_at: StoreMillis,
    pub attempt_started_at: StoreMillis,
}

/// The final report of one Step execution, kept per flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct StepHistoryEntry {
    #[schemars(extend("enum" = [
        history::EXECUTE_COMPLETED,
        history::ATTEMPT_FAILED,
        history::EXECUTE_FAILED,
        history::REDELIVERED
    ]))]
    pub event_type: String,
    pub step_type: String,
    pub step_execution_id: String,
    #[schemars(range(min = 1))]
    pub final_attempt: u32,
    pub at: StoreMillis,
    pub detail: Option<String>,
    /// When the reported attempt started (none in stores from before this
    /// was kept).
    #[serde(default)]
    pub started_at: Option<StoreMillis>,
    /// Only when the Step ran a component: the SHA-256 (hex) of the
    /// version (runner or tool) the reported attempt ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String", regex(pattern = "^[0-9a-f]{64}$"))]
    pub component: Option<String>,
}

/// History event types.
pub mod history {
    /// The Step committed its result.
    pub const EXECUTE_COMPLETED: &str = "execute_completed";
    /// One attempt failed; another follows.
    pub const ATTEMPT_FAILED: &str = "attempt_failed";
    /// The last attempt failed; the failure route (or flow failure) follows.
    pub const EXECUTE_FAILED: &str = "execute_failed";
    /// The worker was lost before it produced anything; the same attempt is
    /// delivered again.
    pub const REDELIVERED: &str = "redelivered";
}

/// Where a flow stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FlowStatus {
    Running,
    Completed,
    Failed,
    Stopped,
}

impl FlowStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            FlowStatus::Running => "running",
            FlowStatus::Completed => "completed",
            FlowStatus::Failed => "failed",
            FlowStatus::Stopped => "stopped",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "running" => Some(FlowStatus::Running),
            "completed" => Some(FlowStatus::Completed),
            "failed" => Some(FlowStatus::Failed),
            "stopped" => Some(FlowStatus::Stopped),
            _ => None,
        }
    }
}

/// Tasks by state, over all flows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskCounts {
    /// Runnable now, or after a retry's back-off.
    pub ready: u64,
    /// Waiting for a message or a timer (an idle session's next turn).
    pub waiting: u64,
    /// Running under a worker's lease.
    pub leased: u64,
}

impl TaskCounts {
    /// Adds `count` tasks of `state` (a value of the tasks' `state` column).
    pub fn add(&mut self, state: &str, count: u64) {
        match state {
            "ready" => self.ready += count,
            "waiting" => self.waiting += count,
            "leased" => self.leased += count,
            _ => {}
        }
    }
}

/// A flow's row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowInfo {
    pub flow_id: String,
    pub flow_type: String,
    pub status: FlowStatus,
    pub created_at: StoreMillis,
    pub updated_at: StoreMillis,
    pub error: Option<String>,
}

/// Where a page of [`FlowStore::list_flows`] ends: the next page starts
/// after this flow, in the listing's order (newest first, ties by id).
///
/// [`FlowStore::list_flows`]: super::FlowStore::list_flows
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowCursor {
    pub created_at: StoreMillis,
    pub flow_id: String,
}

impl FlowCursor {
    /// The cursor after `flow`.
    pub fn after(flow: &FlowInfo) -> Self {
        Self {
            created_at: flow.created_at,
            flow_id: flow.flow_id.clone(),
        }
    }
}

/// A stored value with its version (1 on first write).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Versioned {
    pub value: Json,
    pub version: i64,
}

/// A query over the keys of an AttributeMap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MapQuery {
    /// Only keys greater than this.
    pub after: Option<String>,
    /// Only keys less than this.
    pub before: Option<String>,
    /// Newest (greatest) keys first.
    pub descending: bool,
    pub limit: usize,
    /// Stop once the stored values read so far hold this many bytes: the
    /// row that reaches it is the last one returned (so a page is never
    /// empty for it). The store counts before anything is read into the
    /// host, so a reader bounds its memory by this and one row.
    pub max_bytes: Option<u64>,
}

/// A stream entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamEntry {
    pub seq: i64,
    pub payload: Json,
    pub at: StoreMillis,
}

/// A page of a stream, read by cursor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamPage {
    pub entries: Vec<StreamEntry>,
    /// The oldest sequence number still kept (older ones were trimmed).
    pub first_seq: i64,
    /// The sequence number the next append will get.
    pub next_seq: i64,
}
