//! Tasks on PostgreSQL: inserting, waking, fencing, committing and failing
//! them (claims and leases are in `claims.rs`).
//!
//! Concurrency, which SQLite's single writer gives for free, is explicit
//! here:
//! - every write that changes a flow's tasks, channels or state first locks
//!   the flow's row ([`lock_flow`]), so that the writes of one flow apply one
//!   at a time (a publish and a waiter's count cannot miss each other);
//! - a commit locks the flow's row before any task or stream row, the
//!   order every writer of a flow follows.

use deadpool_postgres::GenericClient;

use super::sql::{execute, query_opt, TxResult};
use crate::flow::store::{AttemptFailure, FailureAction, StepCommit, StoreError};
use crate::flow::types::{NewTask, StoreMillis};
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

/// Inserts a task; a task whose channel condition already holds is ready.
pub(super) async fn insert_task<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    flow_type: &str,
    task: &NewTask,
) -> TxResult<i64> {
    let channel = task.wait.as_ref().and_then(|w| w.channel.as_ref());
    let wake_at = task.wait.as_ref().and_then(|w| w.timer_at);
    let state = if task.wait.is_some() {
        "waiting"
    } else {
        "ready"
    };
    let policy =
        serde_json::to_string(&task.policy).map_err(|err| StoreError::Backend(err.to_string()))?;
    let locks =
        serde_json::to_string(&task.locks).map_err(|err| StoreError::Backend(err.to_string()))?;
    let input = task.input.to_string();
    let wait_channel = channel.map(|c| c.channel.as_str());
    let wait_key = channel.map(|c| c.key.as_str());
    let wait_count = channel.map(|c| i64::from(c.count));
    let row = super::sql::query_one(
        tx,
        "INSERT INTO tasks (flow_id, flow_type, step_type, input, state, attempt, not_before_ms,
            wait_channel, wait_key, wait_count, wake_at_ms, policy, failure_route, failure, locks)
         VALUES ($1, $2, $3, $4, $5, 1, $6, $7, $8, $9, $10, $11, $12, $13, $14)
         RETURNING task_id",
        &[
            &flow_id,
            &flow_type,
            &task.step_type,
            &input,
            &state,
            &task.not_before,
            &wait_channel,
            &wait_key,
            &wait_count,
            &wake_at,
            &policy,
            &task.failure_route,
            &task.failure,
            &locks,
        ],
    )
    .await?;
    if let Some(channel) = channel {
        wake_waiters(tx, flow_id, &channel.channel, &channel.key).await?;
    }
    Ok(row.get(0))
}

/// Marks waiting tasks ready whose channel condition now holds. Runs under
/// the flow's lock, so the count includes every publish before it.
pub(super) async fn wake_waiters<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    channel: &str,
    key: &str,
) -> TxResult<()> {
    execute(
        tx,
        "UPDATE tasks SET state = 'ready'
         WHERE flow_id = $1 AND state = 'waiting' AND wait_channel = $2 AND wait_key = $3
           AND wait_count <= (SELECT COUNT(*) FROM channel_messages
                              WHERE flow_id = $1 AND channel = $2 AND key = $3)",
        &[&flow_id, &channel, &key],
    )
    .await?;
    Ok(())
}

pub(super) async fn drop_tasks<C: GenericClient>(tx: &C, flow_id: &str) -> TxResult<()> {
    execute(
        tx,
        "DELETE FROM state_locks WHERE flow_id = $1",
        &[&flow_id],
    )
    .await?;
    execute(tx, "DELETE FROM tasks WHERE flow_id = $1", &[&flow_id]).await?;
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

/// Applies a Step's commit; the caller holds the flow's lock.
/// Returns the ids of the next tasks it inserted.
pub(super) async fn commit_step<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    commit: &StepCommit,
) -> TxResult<Vec<i64>> {
    let flow_id = commit.flow_id.as_str();
    // Fences, removes the task, records its history entry and finds the
    // flow type and the task's locks, in one statement: a commit is a few
    // round trips, and each one counts on a busy database.
    let entry = &commit.history;
    let detail = entry.detail.as_deref().filter(|d| !d.is_empty());
    let removed = query_opt(
        tx,
        "WITH fenced AS (
           DELETE FROM tasks WHERE task_id = $1 AND lease_token = $2 AND state = 'leased'
           RETURNING flow_type, locks),
         recorded AS (
           INSERT INTO step_history (flow_id, event_type, step_type, step_execution_id,
               attempt, at_ms, detail, started_at_ms, component)
           SELECT $3::text, $4::text, $5::text, $6::text, $7::bigint, $8::bigint, $9::text,
                  $10::bigint, $11::text
           FROM fenced
           RETURNING 1)
         SELECT flow_type, locks <> '[]', (SELECT COUNT(*) FROM recorded) FROM fenced",
        &[
            &commit.task_id,
            &commit.lease_token,
            &flow_id,
            &entry.event_type,
            &entry.step_type,
            &entry.step_execution_id,
            &i64::from(entry.final_attempt),
            &entry.at,
            &detail,
            &entry.started_at,
            &entry.component,
        ],
    )
    .await?;
    let Some((flow_type, had_locks)) =
        removed.map(|row| (row.get::<_, String>(0), row.get::<_, bool>(1)))
    else {
        return Err(StoreError::StaleLease {
            task_id: commit.task_id,
        }
        .into());
    };
    if commit.complete_flow {
        // First, before any stream or channel row is locked: the flow's other
        // tasks go while this transaction holds nothing another writer waits
        // on.
        drop_tasks(tx, flow_id).await?;
    }
    for message_id in &commit.consumed {
        let deleted = execute(
            tx,
            "DELETE FROM channel_messages WHERE message_id = $1",
            &[message_id],
        )
        .await?;
        if deleted == 0 {
            return Err(StoreError::Conflict(format!(
                "channel message {message_id} was already consumed"
            ))
            .into());
        }
    }
    for write in &commit.writes {
        super::state::apply_write(tx, now, flow_id, write).await?;
    }
    if had_locks {
        release_locks(tx, commit.task_id).await?;
    }
    let mut inserted = Vec::with_capacity(commit.next.len());
    if !commit.complete_flow {
        for task in &commit.next {
            inserted.push(insert_task(tx, flow_id, &flow_type, task).await?);
        }
    }
    let done = commit.complete_flow
        || (commit.next.is_empty()
            && query_opt(
                tx,
                "SELECT 1 FROM tasks WHERE flow_id = $1 LIMIT 1",
                &[&flow_id],
            )
            .await?
            .is_none());
    if done {
        execute(
            tx,
            "UPDATE flows SET status = 'completed', updated_at_ms = $2
             WHERE flow_id = $1 AND status = 'running'",
            &[&flow_id, &now],
        )
        .await?;
    }
    Ok(inserted)
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

/// Removes a task that gave up; returns its flow's type.
pub(super) async fn remove<C: GenericClient>(tx: &C, task_id: i64) -> TxResult<String> {
    let row = super::sql::query_one(
        tx,
        "DELETE FROM tasks WHERE task_id = $1 RETURNING flow_type",
        &[&task_id],
    )
    .await?;
    Ok(row.get(0))
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
            let flow_type = remove(tx, failure.task_id).await?;
            match route {
                Some(route) => {
                    insert_task(tx, &failure.flow_id, &flow_type, route).await?;
                    Ok(())
                }
                None => super::flows::fail_flow(tx, now, &failure.flow_id, flow_error).await,
            }
        }
    }
}
