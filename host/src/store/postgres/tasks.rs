//! Tasks and leases on PostgreSQL.
//!
//! Concurrency, which SQLite's single writer gives for free, is explicit
//! here:
//! - claims lock the tasks they take with `FOR UPDATE SKIP LOCKED`, so
//!   workers on many machines never wait for each other nor take one task
//!   twice;
//! - every write that changes a flow's tasks, channels or state first locks
//!   the flow's row ([`lock_flow`]), so that the writes of one flow apply one
//!   at a time (a publish and a waiter's count cannot miss each other);
//! - a claim that takes a task holding state locks takes the flow's row in
//!   share mode, without waiting (`SKIP LOCKED`), so that an RPC checking
//!   those locks and the claim cannot interleave, and a claim never waits
//!   in a lock cycle.

use deadpool_postgres::GenericClient;

use super::sql::{execute, query, query_opt, TxResult};
use super::state::channel_messages;
use crate::flow::store::{ExpiredLease, StepCommit, StoreError};
use crate::flow::types::{ClaimedTask, NewTask, StoreMillis};
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

fn task_row(row: &tokio_postgres::Row) -> Result<TaskRowRaw, StoreError> {
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
async fn load_task<C: GenericClient>(client: &C, task_id: i64) -> TxResult<Option<TaskRow>> {
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

/// Whether any task of `flow_types` could be claimed now.
pub(super) async fn any_claimable<C: GenericClient>(
    client: &C,
    now: StoreMillis,
    flow_types: &[String],
) -> TxResult<bool> {
    let row = query_opt(
        client,
        "SELECT 1 FROM tasks
         WHERE flow_type = ANY($1)
           AND ((state = 'ready' AND not_before_ms <= $2) OR (state = 'waiting' AND wake_at_ms <= $2))
         LIMIT 1",
        &[&flow_types, &now],
    )
    .await?;
    Ok(row.is_some())
}

/// Which tasks a claim may take.
pub(super) enum ClaimScope<'a> {
    /// Any flow of these types (the worker's poll).
    FlowTypes(&'a [String]),
    /// This flow only (a claim made with a commit).
    Flow(&'a str),
}

/// How many of the oldest due tasks a claim weighs for fairness (at least).
const FAIR_CLAIM_WINDOW: usize = 256;

/// The fair order of the SQLite backend (fewest running Steps of a flow
/// first, among the oldest due tasks), then locked with `SKIP LOCKED`:
/// a task another worker is claiming right now is passed over, not waited
/// for, and is re-checked as still due once locked.
fn claim_sql(filter: &str) -> String {
    format!(
        "WITH due AS (
           SELECT task_id, flow_id, not_before_ms FROM tasks AS t
           WHERE {filter}
             AND ((state = 'ready' AND not_before_ms <= $2) OR (state = 'waiting' AND wake_at_ms <= $2))
           ORDER BY not_before_ms, task_id LIMIT $3),
         ranked AS (
           SELECT task_id, not_before_ms,
                  ROW_NUMBER() OVER (PARTITION BY flow_id ORDER BY not_before_ms, task_id)
                  + (SELECT COUNT(*) FROM tasks AS l WHERE l.flow_id = due.flow_id AND l.state = 'leased')
                  AS score
           FROM due)
         SELECT t.task_id, t.flow_id, t.locks <> '[]' FROM tasks AS t JOIN ranked AS r ON r.task_id = t.task_id
         WHERE (t.state = 'ready' AND t.not_before_ms <= $2) OR (t.state = 'waiting' AND t.wake_at_ms <= $2)
         ORDER BY r.score, r.not_before_ms, t.task_id
         LIMIT $4
         FOR UPDATE OF t SKIP LOCKED"
    )
}

pub(super) async fn claim<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    worker_id: &str,
    scope: ClaimScope<'_>,
    max: usize,
    lease_ms: i64,
) -> TxResult<Vec<ClaimedTask>> {
    let window = max.saturating_mul(4).max(FAIR_CLAIM_WINDOW) as i64;
    // More candidates than it takes: one whose flow is busy is passed over
    // for the next, not allowed to leave the claim empty.
    let fetch = max.saturating_mul(4).max(4) as i64;
    let candidates = match scope {
        ClaimScope::FlowTypes(flow_types) => {
            query(
                tx,
                &claim_sql("flow_type = ANY($1)"),
                &[&flow_types, &now, &window, &fetch],
            )
            .await?
        }
        // A flow's next Step rides with its commit only on a sequential
        // path (see the SQLite backend).
        ClaimScope::Flow(flow_id) => {
            query(
                tx,
                &claim_sql(
                    "flow_id = $1 AND NOT EXISTS (SELECT 1 FROM tasks AS l
                        WHERE l.flow_id = t.flow_id AND l.state = 'leased')",
                ),
                &[&flow_id, &now, &window, &fetch],
            )
            .await?
        }
    };
    let mut ids = Vec::with_capacity(candidates.len());
    for row in &candidates {
        if ids.len() >= max {
            break;
        }
        let (task_id, flow_id, has_locks): (i64, String, bool) =
            (row.get(0), row.get(1), row.get(2));
        if has_locks {
            // A writer of this flow (an RPC checking its locks) is busy:
            // leave the task for the next claim rather than wait.
            let free = query_opt(
                tx,
                "SELECT 1 FROM flows WHERE flow_id = $1 FOR SHARE SKIP LOCKED",
                &[&flow_id],
            )
            .await?;
            if free.is_none() {
                continue;
            }
        }
        ids.push(task_id);
    }
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let leased = query(
        tx,
        &format!(
            "UPDATE tasks SET state = 'leased', lease_owner = $2, lease_token = lease_token + 1,
                lease_expires_ms = $3, attempt_started_at_ms = $4,
                first_attempt_at_ms = COALESCE(first_attempt_at_ms, $4), output_recorded = FALSE,
                timer_fired = (wake_at_ms IS NOT NULL AND wake_at_ms <= $4)
             WHERE task_id = ANY($1) RETURNING {TASK_COLUMNS}"
        ),
        &[&ids, &worker_id, &(now + lease_ms), &now],
    )
    .await?;
    let mut rows = leased
        .iter()
        .map(|row| decode_task(task_row(row)?))
        .collect::<Result<Vec<TaskRow>, StoreError>>()?;
    // In the fair order the candidates came in.
    rows.sort_by_key(|row| ids.iter().position(|id| *id == row.task.task_id));
    let mut claimed = Vec::with_capacity(rows.len());
    for TaskRow { mut task, wait, .. } in rows {
        if let Some((channel, key, count)) = wait {
            let messages = channel_messages(tx, &task.flow_id, &channel, &key, count).await?;
            // A timer can wake the task before the condition holds; then it
            // gets no messages.
            if messages.len() as u32 >= count {
                task.messages = messages;
            }
        }
        for name in &task.locks {
            execute(
                tx,
                "INSERT INTO state_locks (flow_id, name, task_id) VALUES ($1, $2, $3)
                 ON CONFLICT DO NOTHING",
                &[&task.flow_id, name, &task.task_id],
            )
            .await?;
        }
        claimed.push(task);
    }
    Ok(claimed)
}

/// Extends the leases `worker_id` holds; returns the pairs it lost.
///
/// A row another transaction holds right now (this worker's own commit of
/// it, a reaper deciding about it) is passed over, not waited for: waiting
/// could close a cycle with a commit that drops a flow's tasks. Such a row
/// counts as lost only if it is no longer this worker's lease; otherwise the
/// next renewal takes it.
pub(super) async fn renew_leases<C: GenericClient>(
    client: &C,
    now: StoreMillis,
    worker_id: &str,
    held: &[(i64, i64)],
    lease_ms: i64,
) -> TxResult<Vec<(i64, i64)>> {
    let ids: Vec<i64> = held.iter().map(|(id, _)| *id).collect();
    let tokens: Vec<i64> = held.iter().map(|(_, token)| *token).collect();
    let renewed = query(
        client,
        "UPDATE tasks AS t SET lease_expires_ms = $1
         FROM unnest($2::bigint[], $3::bigint[]) AS h(task_id, lease_token)
         WHERE t.task_id = h.task_id AND t.lease_token = h.lease_token
           AND t.state = 'leased' AND t.lease_owner = $4
           AND t.task_id IN (SELECT task_id FROM tasks WHERE task_id = ANY($2)
                             FOR UPDATE SKIP LOCKED)
         RETURNING t.task_id, t.lease_token",
        &[&(now + lease_ms), &ids, &tokens, &worker_id],
    )
    .await?;
    let kept: std::collections::HashSet<(i64, i64)> =
        renewed.iter().map(|row| (row.get(0), row.get(1))).collect();
    let missing: Vec<(i64, i64)> = held
        .iter()
        .copied()
        .filter(|pair| !kept.contains(pair))
        .collect();
    if missing.is_empty() {
        return Ok(Vec::new());
    }
    let missing_ids: Vec<i64> = missing.iter().map(|(id, _)| *id).collect();
    let still_ours: std::collections::HashSet<(i64, i64)> = query(
        client,
        "SELECT task_id, lease_token FROM tasks
         WHERE task_id = ANY($1) AND state = 'leased' AND lease_owner = $2",
        &[&missing_ids, &worker_id],
    )
    .await?
    .iter()
    .map(|row| (row.get(0), row.get(1)))
    .collect();
    Ok(missing
        .into_iter()
        .filter(|pair| !still_ours.contains(pair))
        .collect())
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
pub(super) async fn commit_step<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    commit: &StepCommit,
) -> TxResult<()> {
    let flow_id = commit.flow_id.as_str();
    // Fences, finds the flow type and removes the task in one statement.
    let removed = query_opt(
        tx,
        "DELETE FROM tasks WHERE task_id = $1 AND lease_token = $2 AND state = 'leased'
         RETURNING flow_type",
        &[&commit.task_id, &commit.lease_token],
    )
    .await?;
    let Some(flow_type) = removed.map(|row| row.get::<_, String>(0)) else {
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
    super::history::insert_history(tx, flow_id, &commit.history).await?;
    execute(
        tx,
        "DELETE FROM state_locks WHERE task_id = $1",
        &[&commit.task_id],
    )
    .await?;
    if !commit.complete_flow {
        for task in &commit.next {
            insert_task(tx, flow_id, &flow_type, task).await?;
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
    Ok(())
}

/// Tasks of `flow_types` whose lease has run out.
pub(super) async fn expired_leases<C: GenericClient>(
    client: &C,
    now: StoreMillis,
    flow_types: &[String],
    limit: usize,
) -> TxResult<Vec<ExpiredLease>> {
    let rows = query(
        client,
        "SELECT task_id FROM tasks WHERE state = 'leased' AND lease_expires_ms <= $1
           AND flow_type = ANY($2) ORDER BY lease_expires_ms LIMIT $3",
        &[&now, &flow_types, &(limit as i64)],
    )
    .await?;
    let mut expired = Vec::with_capacity(rows.len());
    for row in rows {
        // A task committed since the first read is simply gone.
        let task_id: i64 = row.get(0);
        if let Some(row) = load_task(client, task_id).await? {
            expired.push(ExpiredLease {
                task: row.task,
                output_recorded: row.output_recorded,
            });
        }
    }
    Ok(expired)
}

/// The earliest time a task of `flow_types` becomes due, if any.
pub(super) async fn next_due<C: GenericClient>(
    client: &C,
    flow_types: &[String],
) -> TxResult<Option<StoreMillis>> {
    let row = super::sql::query_one(
        client,
        "SELECT LEAST(
           (SELECT MIN(not_before_ms) FROM tasks WHERE state = 'ready' AND flow_type = ANY($1)),
           (SELECT MIN(wake_at_ms) FROM tasks WHERE state = 'waiting' AND flow_type = ANY($1)),
           (SELECT MIN(lease_expires_ms) FROM tasks WHERE state = 'leased' AND flow_type = ANY($1)))",
        &[&flow_types],
    )
    .await?;
    Ok(row.get(0))
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
