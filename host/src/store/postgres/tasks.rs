//! Tasks on PostgreSQL: inserting, waking, fencing and failing them (a
//! Step's commit is in `commit.rs`, claims and leases in `claims.rs`).
//!
//! Concurrency, which SQLite's single writer gives for free, is explicit
//! here:
//! - every write that changes a flow's tasks, channels or state first locks
//!   the flow's row ([`lock_flow`]), so that the writes of one flow apply one
//!   at a time (a publish and a waiter's count cannot miss each other);
//! - a commit locks the flow's row before any task or stream row, the
//!   order every writer of a flow follows.

use deadpool_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::sql::{execute, query_opt, TxError, TxResult};
use crate::flow::store::{AttemptFailure, FailureAction, StoreError};
use crate::flow::types::{NewTask, StoreMillis, TakenTask};
use crate::store::rows::{decode_task, TaskRow, TaskRowRaw, TASK_COLUMNS};

/// Locks `flow_id`'s row for the rest of the transaction; its type, or
/// `None` when there is no such flow.
pub(super) async fn lock_flow<C: GenericClient>(tx: &C, flow_id: &str) -> TxResult<Option<String>> {
    let row = query_opt(
        tx,
        "SELECT flow_type FROM flows WHERE flow_id = $1 FOR UPDATE",
        &[&flow_id],
    )
    .await?;
    Ok(row.map(|row| row.get(0)))
}

/// [`lock_flow`], or, for a flow that does not exist (yet), a
/// transaction-scoped lock on its name, which `create_flow` takes too.
pub(super) async fn lock_flow_or_its_name<C: GenericClient>(tx: &C, flow_id: &str) -> TxResult<()> {
    if lock_flow(tx, flow_id).await?.is_none() {
        execute(
            tx,
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
            &[&flow_id],
        )
        .await?;
    }
    Ok(())
}

/// Inserts a task of `flow_id` ($1), of the flow's type: the values from
/// $2 on are [`TaskValues::params`].
pub(super) const INSERT_TASK: &str =
    "INSERT INTO tasks (flow_id, flow_type, step_type, input, state, attempt, not_before_ms,
        wait_channel, wait_key, wait_count, wake_at_ms, policy, failure_route, failure, locks)
     VALUES ($1, (SELECT flow_type FROM flows WHERE flow_id = $1), $2, $3, $4, 1, $5, $6, $7,
             $8, $9, $10, $11, $12, $13)
     RETURNING task_id";

/// Marks waiting tasks ready whose channel condition now holds ($1 the
/// flow, $2 the channel, $3 the key). Runs under the flow's lock, so the
/// count includes every publish before it.
pub(super) const WAKE_WAITERS: &str = "UPDATE tasks SET state = 'ready'
     WHERE flow_id = $1 AND state = 'waiting' AND wait_channel = $2 AND wait_key = $3
       AND wait_count <= (SELECT COUNT(*) FROM channel_messages
                          WHERE flow_id = $1 AND channel = $2 AND key = $3)";

/// A new task's column values, encoded once, for [`INSERT_TASK`].
pub(super) struct TaskValues<'a> {
    task: &'a NewTask,
    input: String,
    state: &'static str,
    policy: String,
    locks: String,
    wait_channel: Option<&'a str>,
    wait_key: Option<&'a str>,
    wait_count: Option<i64>,
    wake_at: Option<StoreMillis>,
}

impl<'a> TaskValues<'a> {
    pub(super) fn new(task: &'a NewTask) -> Result<Self, StoreError> {
        let channel = task.wait.as_ref().and_then(|w| w.channel.as_ref());
        let encode = |value: Result<String, serde_json::Error>| {
            value.map_err(|err| StoreError::Backend(err.to_string()))
        };
        Ok(TaskValues {
            task,
            input: task.input.to_string(),
            state: if task.wait.is_some() {
                "waiting"
            } else {
                "ready"
            },
            policy: encode(serde_json::to_string(&task.policy))?,
            locks: encode(serde_json::to_string(&task.locks))?,
            wait_channel: channel.map(|c| c.channel.as_str()),
            wait_key: channel.map(|c| c.key.as_str()),
            wait_count: channel.map(|c| i64::from(c.count)),
            wake_at: task.wait.as_ref().and_then(|w| w.timer_at),
        })
    }

    /// $2 to $13 of [`INSERT_TASK`].
    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 12] {
        [
            &self.task.step_type,
            &self.input,
            &self.state,
            &self.task.not_before,
            &self.wait_channel,
            &self.wait_key,
            &self.wait_count,
            &self.wake_at,
            &self.policy,
            &self.task.failure_route,
            &self.task.failure,
            &self.locks,
        ]
    }

    /// The channel the task waits on, when its insert must wake waiters.
    pub(super) fn channel(&self) -> Option<(&'a str, &'a str)> {
        self.wait_channel.zip(self.wait_key)
    }

    /// $2 and $3 of [`WAKE_WAITERS`], when the task waits on a channel.
    pub(super) fn channel_params(&self) -> Option<[&(dyn ToSql + Sync); 2]> {
        self.channel()
            .map(|_| [&self.wait_channel as &(dyn ToSql + Sync), &self.wait_key])
    }
}

/// Inserts a task; a task whose channel condition already holds is ready.
pub(super) async fn insert_task<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    task: &NewTask,
) -> TxResult<i64> {
    let values = TaskValues::new(task)?;
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&flow_id];
    params.extend(values.params());
    let row = super::sql::query_one(tx, INSERT_TASK, &params).await?;
    if let Some((channel, key)) = values.channel() {
        wake_waiters(tx, flow_id, channel, key).await?;
    }
    Ok(row.get(0))
}

/// Runs [`WAKE_WAITERS`].
pub(super) async fn wake_waiters<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    channel: &str,
    key: &str,
) -> TxResult<()> {
    execute(tx, WAKE_WAITERS, &[&flow_id, &channel, &key]).await?;
    Ok(())
}

/// Drops the flow's tasks and their locks, returning them as
/// [`TakenTask`]s, oldest first. One `DELETE ... RETURNING`: a heartbeat or
/// "started" marker that commits meanwhile is waited for and its value
/// returned, where a read before the delete could miss it.
pub(super) async fn take_tasks<C: GenericClient>(
    tx: &C,
    flow_id: &str,
) -> TxResult<Vec<TakenTask>> {
    execute(tx, DROP_LOCKS, &[&flow_id]).await?;
    let rows = super::sql::query(
        tx,
        "DELETE FROM tasks WHERE flow_id = $1
         RETURNING task_id, step_type, input, state, output_recorded, attempt, failure",
        &[&flow_id],
    )
    .await?;
    let mut taken = rows
        .iter()
        .map(|row| {
            let task_id: i64 = row.get(0);
            let input: String = row.get(2);
            let state: String = row.get(3);
            let attempt: i64 = row.get(5);
            Ok((
                task_id,
                TakenTask {
                    step_type: row.get(1),
                    input: serde_json::from_str(&input).map_err(|err| {
                        TxError::from(StoreError::Corrupt(format!("task input: {err}")))
                    })?,
                    leased: state == "leased",
                    output_recorded: row.get(4),
                    attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
                    failure: row.get(6),
                },
            ))
        })
        .collect::<TxResult<Vec<_>>>()?;
    taken.sort_by_key(|(task_id, _)| *task_id);
    Ok(taken.into_iter().map(|(_, task)| task).collect())
}

/// Whether the lease `(task_id, lease_token)` stands.
pub(super) async fn lease_held<C: GenericClient>(
    client: &C,
    task_id: i64,
    lease_token: i64,
) -> TxResult<bool> {
    Ok(super::sql::query_opt(
        client,
        "SELECT 1 FROM tasks WHERE task_id = $1 AND lease_token = $2 AND state = 'leased'",
        &[&task_id, &lease_token],
    )
    .await?
    .is_some())
}

/// Drops a flow's state locks ($1 the flow), before [`DROP_TASKS`].
pub(super) const DROP_LOCKS: &str = "DELETE FROM state_locks WHERE flow_id = $1";
/// Drops a flow's tasks ($1 the flow).
pub(super) const DROP_TASKS: &str = "DELETE FROM tasks WHERE flow_id = $1";

pub(super) async fn drop_tasks<C: GenericClient>(tx: &C, flow_id: &str) -> TxResult<()> {
    execute(tx, DROP_LOCKS, &[&flow_id]).await?;
    execute(tx, DROP_TASKS, &[&flow_id]).await?;
    Ok(())
}

pub(super) fn task_row(row: &tokio_postgres::Row) -> Result<TaskRowRaw, StoreError> {
    let task_id: i64 = row.get(0);
    let number = |value: i64, what: &str| {
        u32::try_from(value)
            .map_err(|_| StoreError::Corrupt(format!("task {task_id} has {what} {value}")))
    };
    let channel: Option<String> = row.get(14);
    let wait = match channel {
        Some(channel) => {
            let key: Option<String> = row.get(15);
            let count: Option<i64> = row.get(16);
            Some((
                channel,
                key.unwrap_or_default(),
                number(count.unwrap_or(0), "wait count")?,
            ))
        }
        None => None,
    };
    Ok(TaskRowRaw {
        task_id,
        flow_id: row.get(1),
        flow_type: row.get(2),
        step_type: row.get(3),
        input: row.get(4),
        attempt: number(row.get(5), "attempt")?,
        lease_token: row.get(6),
        policy: row.get(7),
        failure_route: row.get(8),
        failure: row.get(9),
        locks: row.get(10),
        timer_fired: row.get(11),
        first_attempt_at: row.get::<_, Option<i64>>(12).unwrap_or(0),
        attempt_started_at: row.get::<_, Option<i64>>(13).unwrap_or(0),
        wait,
        output_recorded: row.get(17),
    })
}

/// A task, or `None` once it is gone.
pub(super) async fn load_task<C: GenericClient>(
    client: &C,
    task_id: i64,
) -> TxResult<Option<TaskRow>> {
    let row = query_opt(
        client,
        &format!("SELECT {TASK_COLUMNS} FROM tasks WHERE task_id = $1"),
        &[&task_id],
    )
    .await?;
    match row {
        Some(row) => Ok(Some(decode_task(task_row(&row)?)?)),
        None => Ok(None),
    }
}

/// Marks that the leased attempt produced output, fenced by its token and
/// by a lease that has not run out (see the SQLite backend for why).
pub(super) async fn record_output<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    task_id: i64,
    lease_token: i64,
) -> TxResult<()> {
    let updated = execute(
        tx,
        "UPDATE tasks SET output_recorded = TRUE
             WHERE task_id = $1 AND lease_token = $2 AND state = 'leased'
               AND lease_expires_ms > $3",
        &[&task_id, &lease_token, &now],
    )
    .await?;
    if updated == 0 {
        return Err(StoreError::StaleLease { task_id }.into());
    }
    Ok(())
}

/// Refuses unless `task_id` is leased under `lease_token` (and, for the
/// reaper, its lease has run out by `expired_by`); locks the task's row.
pub(super) async fn check_lease<C: GenericClient>(
    tx: &C,
    task_id: i64,
    lease_token: i64,
    expired_by: Option<StoreMillis>,
) -> TxResult<()> {
    let held = query_opt(
        tx,
        "SELECT 1 FROM tasks WHERE task_id = $1 AND lease_token = $2 AND state = 'leased'
           AND ($3::bigint IS NULL OR lease_expires_ms <= $3)
         FOR UPDATE",
        &[&task_id, &lease_token, &expired_by],
    )
    .await?;
    if held.is_some() {
        Ok(())
    } else {
        Err(StoreError::StaleLease { task_id }.into())
    }
}

/// Releases the state locks a task held.
pub(super) async fn release_locks<C: GenericClient>(tx: &C, task_id: i64) -> TxResult<()> {
    execute(
        tx,
        "DELETE FROM state_locks WHERE task_id = $1",
        &[&task_id],
    )
    .await?;
    Ok(())
}

/// Makes a failed task ready again at `attempt`, not before `not_before`.
pub(super) async fn retry<C: GenericClient>(
    tx: &C,
    task_id: i64,
    attempt: u32,
    not_before: StoreMillis,
) -> TxResult<()> {
    execute(
        tx,
        "UPDATE tasks SET state = 'ready', attempt = $2, not_before_ms = $3,
         lease_owner = NULL, lease_expires_ms = NULL, output_recorded = FALSE
         WHERE task_id = $1",
        &[&task_id, &i64::from(attempt), &not_before],
    )
    .await?;
    Ok(())
}

/// Delivers the same attempt again, only while it provably produced
/// nothing: checked in this statement, on the row [`check_lease`] locked,
/// so that a "started" write committed before wins and the whole failure
/// is rolled back.
pub(super) async fn redeliver<C: GenericClient>(tx: &C, task_id: i64) -> TxResult<()> {
    let redelivered = execute(
        tx,
        "UPDATE tasks SET state = 'ready', lease_owner = NULL, lease_expires_ms = NULL
         WHERE task_id = $1 AND output_recorded = FALSE",
        &[&task_id],
    )
    .await?;
    if redelivered == 0 {
        return Err(StoreError::OutputRecorded { task_id }.into());
    }
    Ok(())
}

/// Removes a task that gave up.
pub(super) async fn remove<C: GenericClient>(tx: &C, task_id: i64) -> TxResult<()> {
    execute(tx, "DELETE FROM tasks WHERE task_id = $1", &[&task_id]).await?;
    Ok(())
}

/// A failed attempt: history, locks released, then retry, redeliver or
/// give up (the SQLite backend documents each case).
pub(super) async fn fail_attempt<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    failure: &AttemptFailure,
) -> TxResult<()> {
    lock_flow(tx, &failure.flow_id).await?;
    check_lease(
        tx,
        failure.task_id,
        failure.lease_token,
        failure.require_expired.then_some(now),
    )
    .await?;
    super::history::insert_history(tx, &failure.flow_id, &failure.history).await?;
    release_locks(tx, failure.task_id).await?;
    match &failure.action {
        FailureAction::Retry {
            attempt,
            not_before,
        } => retry(tx, failure.task_id, *attempt, *not_before).await,
        FailureAction::Redeliver => redeliver(tx, failure.task_id).await,
        FailureAction::GiveUp { route, flow_error } => {
            remove(tx, failure.task_id).await?;
            match route {
                Some(route) => {
                    insert_task(tx, &failure.flow_id, route).await?;
                    Ok(())
                }
                None => super::flows::fail_flow(tx, now, &failure.flow_id, flow_error).await,
            }
        }
    }
}
