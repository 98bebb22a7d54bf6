//! The storage trait every backend implements. The engine's logic (retries,
//! routing, waits) lives in `flow`; a backend only stores, fences and wakes.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Notify;

use super::types::{
    ClaimedTask, FlowCursor, FlowInfo, FlowStatus, Json, MapQuery, NewTask, StateWrite,
    StepHistoryEntry, StoreMillis, StreamPage, TakenTask, TaskCounts, Versioned,
};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The lease was lost: another worker holds the task now, or it is gone.
    #[error("stale lease for task {task_id}: the commit is refused")]
    StaleLease { task_id: i64 },
    /// A redelivery of the same attempt was refused: the attempt recorded
    /// output after the reaper looked, so it may have acted; decide again.
    #[error("task {task_id} recorded output; it cannot be delivered again at the same attempt")]
    OutputRecorded { task_id: i64 },
    #[error("flow {flow_id} already exists")]
    FlowExists { flow_id: String },
    #[error("flow {flow_id} does not exist")]
    NoSuchFlow { flow_id: String },
    /// A live append to a flow that no longer runs: its streams take no
    /// more entries.
    #[error("flow {flow_id} is {status}; its streams take no more entries")]
    FlowEnded { flow_id: String, status: String },
    /// Messages the Step consumed were taken by someone else first.
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("corrupt stored value: {0}")]
    Corrupt(String),
    #[error("store backend: {0}")]
    Backend(String),
}

/// Why an RPC failed.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// A running Step holds a lock the RPC needs; retry shortly.
    #[error("lock conflict on {name} of flow {flow_id}")]
    LockConflict { flow_id: String, name: String },
    /// The RPC's own logic refused the call.
    #[error("{0}")]
    Rejected(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A Step's commit: everything it did, applied in one transaction, fenced by
/// its lease token.
#[derive(Clone, Debug)]
pub struct StepCommit {
    pub task_id: i64,
    pub lease_token: i64,
    pub flow_id: String,
    /// Channel messages the Step consumed.
    pub consumed: Vec<i64>,
    pub writes: Vec<StateWrite>,
    pub next: Vec<NewTask>,
    /// Complete the flow now, dropping its other tasks.
    pub complete_flow: bool,
    pub history: StepHistoryEntry,
    /// Lease up to `max` of the flow's next ready tasks to the committing
    /// worker in the same transaction, saving a claim round trip on a
    /// flow's critical path.
    pub claim_next: Option<ClaimNext>,
}

/// A claim made together with a commit: at most `max` ready tasks of the
/// committing flow.
#[derive(Clone, Debug)]
pub struct ClaimNext {
    pub worker_id: String,
    pub max: usize,
    pub lease_ms: i64,
}

/// What happens to a task after a failed attempt.
#[derive(Clone, Debug)]
pub enum FailureAction {
    /// Try again at `attempt`, not before `not_before`.
    Retry {
        attempt: u32,
        not_before: StoreMillis,
    },
    /// Deliver the same attempt again (the worker was lost before it produced
    /// anything). Refused with [`StoreError::OutputRecorded`] when the attempt
    /// has recorded output by the time the failure is applied.
    Redeliver,
    /// Give up on the task; run `route` (the failure route), if any, else fail
    /// the flow with `flow_error`.
    GiveUp {
        route: Option<Box<NewTask>>,
        flow_error: String,
    },
}

/// A failed attempt, applied fenced by the lease token.
#[derive(Clone, Debug)]
pub struct AttemptFailure {
    pub task_id: i64,
    pub lease_token: i64,
    pub flow_id: String,
    pub action: FailureAction,
    pub history: StepHistoryEntry,
    /// Apply only if the lease has also run out (the reaper's case).
    pub require_expired: bool,
}

impl AttemptFailure {
    /// The failure of `task`'s current attempt, fenced by its lease token.
    pub fn of(
        task: &ClaimedTask,
        (action, history): (FailureAction, StepHistoryEntry),
        require_expired: bool,
    ) -> Self {
        Self {
            task_id: task.task_id,
            lease_token: task.lease_token,
            flow_id: task.flow_id.clone(),
            action,
            history,
            require_expired,
        }
    }
}

/// One read of [`FlowStore::read_state`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateQuery {
    /// An Attribute (empty key) or one key of an AttributeMap.
    Get { name: String, key: String },
    /// Keys of an AttributeMap.
    Map { name: String, query: MapQuery },
}

impl StateQuery {
    pub fn get(name: &str, key: &str) -> Self {
        StateQuery::Get {
            name: name.to_string(),
            key: key.to_string(),
        }
    }

    pub fn map(name: &str, query: MapQuery) -> Self {
        StateQuery::Map {
            name: name.to_string(),
            query,
        }
    }
}

/// The answer to one [`StateQuery`], in the same position.
#[derive(Clone, Debug, PartialEq)]
pub enum StateAnswer {
    Value(Option<Versioned>),
    Entries(Vec<(String, Versioned)>),
}

/// A task whose lease ran out.
#[derive(Clone, Debug)]
pub struct ExpiredLease {
    pub task: ClaimedTask,
    /// Whether the Step recorded output (a heartbeat) before its worker went.
    pub output_recorded: bool,
}

/// The state an RPC may read and change, inside one transaction.
pub trait StateTx {
    fn now(&self) -> StoreMillis;
    fn flow(&mut self) -> Result<Option<FlowInfo>, StoreError>;
    fn get(&mut self, name: &str, key: &str) -> Result<Option<Versioned>, StoreError>;
    fn set(&mut self, name: &str, key: &str, value: Json) -> Result<i64, StoreError>;
    fn delete(&mut self, name: &str, key: &str) -> Result<(), StoreError>;
    /// Fails with a lock conflict while a running Step holds `name`.
    fn lock(&mut self, name: &str) -> Result<(), RpcError>;
    fn publish(&mut self, channel: &str, key: &str, payload: Json) -> Result<(), StoreError>;
    fn channel_len(&mut self, channel: &str, key: &str) -> Result<u64, StoreError>;
    fn read_map(
        &mut self,
        name: &str,
        query: &MapQuery,
    ) -> Result<Vec<(String, Versioned)>, StoreError>;
    /// Drops every task of the flow (waiting, due or running) with their
    /// locks, and says what each was, oldest first, as of the drop (a
    /// running Step's "started" marker committed meanwhile is seen). A
    /// running Step loses its lease: its commit and its heartbeats are
    /// refused, and its worker, woken by the flow's revocation signal at
    /// commit, stops it (see [`FlowStore::revocation_signal`]).
    fn take_tasks(&mut self) -> Result<Vec<TakenTask>, StoreError>;
    /// Adds a task to the flow.
    fn add_task(&mut self, task: NewTask) -> Result<(), StoreError>;
    /// Appends `payload` to the flow's `stream`; its readers are woken at
    /// commit. Before [`Self::take_tasks`] in one transaction: a running
    /// Step's own append locks the stream before its task, and the same
    /// order keeps the two from deadlocking.
    fn append(&mut self, stream: &str, payload: Json) -> Result<i64, StoreError>;
}

/// The body of an RPC; its value travels back type-erased.
pub type RpcBody =
    Box<dyn FnOnce(&mut dyn StateTx) -> Result<Box<dyn Any + Send>, RpcError> + Send>;

/// A durable store for flows.
#[async_trait]
pub trait FlowStore: Send + Sync + 'static {
    /// The store's clock: deadlines and timers use it, not the worker's.
    async fn now(&self) -> Result<StoreMillis, StoreError>;

    /// Woken when new work may be ready: in-process at once, across
    /// processes within the backend's poll interval.
    fn work_signal(&self) -> Arc<Notify>;

    /// Woken (`notify_waiters`) when entries are appended to a stream of
    /// `flow_id`, by any process, if the backend can say so; `None` when
    /// readers must poll.
    fn stream_signal(&self, flow_id: &str) -> Option<Arc<Notify>> {
        let _ = flow_id;
        None
    }

    /// How many times the readers of `flow_id`'s streams were woken because
    /// its tasks were taken (a stop, a cancel), while some reader held its
    /// [`Self::stream_signal`]; it only grows while they do. A stop appends
    /// nothing, and its wake may reach a reader together with an append's:
    /// a reader that sees this move looks at the flow's status. 0 when the
    /// backend does not push.
    fn stream_stops(&self, flow_id: &str) -> u64 {
        let _ = flow_id;
        0
    }

    async fn create_flow(
        &self,
        flow_id: &str,
        flow_type: &str,
        first: NewTask,
    ) -> Result<(), StoreError>;
    async fn flow(&self, flow_id: &str) -> Result<Option<FlowInfo>, StoreError>;

    /// How many tasks are in each state, over all flows (the queue depth
    /// `/metrics` shows). A scan of the tasks: for scrapes, not hot paths.
    async fn task_counts(&self) -> Result<TaskCounts, StoreError>;
    /// Flows newest first (ties by id), of `flow_type` if given, after
    /// `after` (the cursor of the last flow of the page before), at most
    /// `limit`.
    async fn list_flows(
        &self,
        flow_type: Option<&str>,
        after: Option<&FlowCursor>,
        limit: usize,
    ) -> Result<Vec<FlowInfo>, StoreError>;
    /// Stops a running flow and drops its tasks; its state stays readable.
    /// False when it was not running.
    async fn stop_flow(&self, flow_id: &str) -> Result<bool, StoreError>;

    /// Leases up to `max` ready tasks of `flow_types` to `worker_id`.
    async fn claim(
        &self,
        worker_id: &str,
        flow_types: &[String],
        max: usize,
        lease_ms: i64,
    ) -> Result<Vec<ClaimedTask>, StoreError>;
    /// Extends the leases a worker holds, as `(task id, lease token)`;
    /// returns the pairs it lost.
    async fn renew_leases(
        &self,
        worker_id: &str,
        held: &[(i64, i64)],
        lease_ms: i64,
    ) -> Result<Vec<(i64, i64)>, StoreError>;
    /// Woken when `flow_id`'s tasks are taken ([`StateTx::take_tasks`], or a
    /// stop), in this process at once and in others through the backend's
    /// own signal; `None` when the store cannot say (the lease renewal is
    /// then how a worker learns it lost a Step).
    fn revocation_signal(&self, _flow_id: &str) -> Option<Arc<Notify>> {
        None
    }
    /// How many revocation wakes this process has seen, of any flow. A
    /// worker reads it before it claims: if it moved by the time the Step's
    /// signal is armed, a wake may have come first, and it looks at the
    /// lease once.
    fn revocation_generation(&self) -> u64 {
        0
    }
    /// Whether the lease `(task_id, lease_token)` still stands: false once
    /// the task was taken from its flow (a cancel), finished, or leased
    /// again. A read: a worker asks it when its flow's streams move while it
    /// runs a Step of that flow, to stop a Step whose task was taken.
    async fn lease_held(&self, task_id: i64, lease_token: i64) -> Result<bool, StoreError>;
    /// Records that the Step produced output (a heartbeat), fenced by the
    /// lease token and by an unexpired lease: a Step whose lease ran out gets
    /// `StaleLease` and must not act. Together with [`FailureAction::Redeliver`]
    /// re-checking that no output was recorded, "output recorded" and
    /// "redelivered at the same attempt" exclude each other on every backend.
    async fn record_output(&self, task_id: i64, lease_token: i64) -> Result<(), StoreError>;
    /// Records output and appends to a stream in one write: a Step's
    /// durable "started" marker together with its live event.
    async fn record_output_and_append(
        &self,
        task_id: i64,
        lease_token: i64,
        flow_id: &str,
        stream: &str,
        payloads: Vec<Json>,
    ) -> Result<(), StoreError> {
        self.record_output(task_id, lease_token).await?;
        self.append_stream(flow_id, stream, payloads).await?;
        Ok(())
    }
    /// Commits a Step; returns the tasks `claim_next` leased, if asked.
    async fn commit_step(&self, commit: StepCommit) -> Result<Vec<ClaimedTask>, StoreError>;
    async fn fail_attempt(&self, failure: AttemptFailure) -> Result<(), StoreError>;
    /// Tasks of `flow_types` whose lease has run out.
    async fn expired_leases(
        &self,
        flow_types: &[String],
        limit: usize,
    ) -> Result<Vec<ExpiredLease>, StoreError>;
    /// The earliest time a task of `flow_types` becomes due (not-before,
    /// timer or lease expiry), if any.
    async fn next_due(&self, flow_types: &[String]) -> Result<Option<StoreMillis>, StoreError>;

    async fn get(
        &self,
        flow_id: &str,
        name: &str,
        key: &str,
    ) -> Result<Option<Versioned>, StoreError>;
    async fn read_map(
        &self,
        flow_id: &str,
        name: &str,
        query: MapQuery,
    ) -> Result<Vec<(String, Versioned)>, StoreError>;
    /// Several reads of one flow's state, from one consistent snapshot.
    async fn read_state(
        &self,
        flow_id: &str,
        queries: Vec<StateQuery>,
    ) -> Result<Vec<StateAnswer>, StoreError>;
    async fn channel_len(&self, flow_id: &str, channel: &str, key: &str)
        -> Result<u64, StoreError>;

    /// Appends to a stream outside any Step commit (live events).
    async fn append_stream(
        &self,
        flow_id: &str,
        stream: &str,
        payloads: Vec<Json>,
    ) -> Result<Vec<i64>, StoreError>;
    async fn read_stream(
        &self,
        flow_id: &str,
        stream: &str,
        after_seq: i64,
        limit: usize,
    ) -> Result<StreamPage, StoreError>;
    /// Sets the byte capacity of a flow's stream (oldest entries are trimmed).
    async fn set_stream_capacity(
        &self,
        flow_id: &str,
        stream: &str,
        capacity_bytes: u64,
    ) -> Result<(), StoreError>;

    /// The flow's whole Step history, oldest first.
    async fn step_history(&self, flow_id: &str) -> Result<Vec<StepHistoryEntry>, StoreError> {
        let page = self.step_history_page(flow_id, None, usize::MAX).await?;
        Ok(page.into_iter().map(|(_, entry)| entry).collect())
    }

    /// At most `limit` entries of the flow's Step history after entry id
    /// `after`, oldest first, each with its entry id (increasing; the last
    /// is the cursor of the next page).
    async fn step_history_page(
        &self,
        flow_id: &str,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<(i64, StepHistoryEntry)>, StoreError>;

    /// Runs `body` in one transaction on `flow_id`'s state.
    async fn rpc(&self, flow_id: &str, body: RpcBody) -> Result<Box<dyn Any + Send>, RpcError>;

    /// [`Self::rpc`] for a body its caller knows to be small: a few rows
    /// and a few KiB (a user message queued). A backend may run it on the
    /// caller's thread when the store is quiet, sparing it a hop to a
    /// writer thread and back; the default is [`Self::rpc`].
    async fn rpc_small(
        &self,
        flow_id: &str,
        body: RpcBody,
    ) -> Result<Box<dyn Any + Send>, RpcError> {
        self.rpc(flow_id, body).await
    }

    /// Runs `body` in one read-only transaction on `flow_id`'s state: every
    /// read sees one consistent snapshot, and every write (`set`, `delete`,
    /// `publish`, `lock`) is refused. Reads that only draw a session (a
    /// snapshot, a page of messages) must not queue behind Step commits and
    /// lease renewals on the writer, nor block the async runtime.
    async fn read_rpc(&self, flow_id: &str, body: RpcBody)
        -> Result<Box<dyn Any + Send>, RpcError>;
}

/// Status helpers shared by backends.
pub fn is_final(status: FlowStatus) -> bool {
    !matches!(status, FlowStatus::Running)
}
