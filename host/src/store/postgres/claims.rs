//! Claims and leases on PostgreSQL.
//!
//! - Claims lock the tasks they take with `FOR UPDATE SKIP LOCKED`, so
//!   workers on many machines never wait for each other nor take one task
//!   twice, and never wait at all: a claim cannot be part of a lock cycle.
//! - A claim that takes a task holding state locks takes the flow's row in
//!   share mode, without waiting (`SKIP LOCKED`), so that an RPC checking
//!   those locks and the claim cannot interleave.
//! - Renewals pass over rows another transaction holds, for the same reason.

use std::sync::LazyLock;

use deadpool_postgres::GenericClient;
use tokio_postgres::Row;

use super::sql::{execute, query, query_opt, TxResult};
use super::state::channel_messages;
use super::tasks::{load_task, task_row};
use crate::flow::store::{ExpiredLease, StoreError};
use crate::flow::types::{ClaimedTask, StoreMillis};
use crate::store::rows::{decode_task, TaskRow, TASK_COLUMNS};

/// Whether any task of `flow_types` could be claimed now. Written as two
/// index minimums: a `LIMIT 1` over both states becomes, in the generic plan
/// a prepared statement settles on, a scan of the whole table (every
/// session waiting for its next message is a row), on the path that most
/// often finds nothing.
pub(super) async fn any_claimable<C: GenericClient>(
    client: &C,
    now: StoreMillis,
    flow_types: &[String],
) -> TxResult<bool> {
    let row = super::sql::query_one(
        client,
        "SELECT COALESCE((SELECT MIN(not_before_ms) FROM tasks
                          WHERE state = 'ready' AND flow_type = ANY($1)) <= $2, FALSE)
             OR COALESCE((SELECT MIN(wake_at_ms) FROM tasks
                          WHERE state = 'waiting' AND wake_at_ms IS NOT NULL
                            AND flow_type = ANY($1)) <= $2, FALSE)",
        &[&flow_types, &now],
    )
    .await?;
    Ok(row.get(0))
}

/// How many of the oldest due tasks a claim weighs for fairness (at least).
const FAIR_CLAIM_WINDOW: usize = 256;

/// The fair order of the SQLite backend: among the oldest due tasks (the
/// window), fewest running Steps of a flow first, counting those the claim
/// takes before it. Read without locks, once: each part is materialized,
/// so no plan can recompute the window per row (one did, for minutes), and
/// each state's due tasks come from its own index in order, so a backlog
/// costs the window, not the backlog.
const FAIR_ORDER: &str = "
    WITH due AS MATERIALIZED (
      SELECT * FROM (
        (SELECT task_id, flow_id, not_before_ms FROM tasks
         WHERE state = 'ready' AND not_before_ms <= $2 AND flow_type = ANY($1)
         ORDER BY not_before_ms, task_id LIMIT $3)
        UNION ALL
        (SELECT task_id, flow_id, not_before_ms FROM tasks
         WHERE state = 'waiting' AND wake_at_ms <= $2 AND flow_type = ANY($1)
         ORDER BY not_before_ms, task_id LIMIT $3)) AS either
      ORDER BY not_before_ms, task_id LIMIT $3),
    running AS MATERIALIZED (
      SELECT flow_id, COUNT(*) AS n FROM tasks
      WHERE flow_id IN (SELECT flow_id FROM due) AND state = 'leased'
      GROUP BY flow_id)
    SELECT due.task_id FROM due LEFT JOIN running ON running.flow_id = due.flow_id
    ORDER BY ROW_NUMBER() OVER (PARTITION BY due.flow_id ORDER BY due.not_before_ms, due.task_id)
               + COALESCE(running.n, 0),
             due.not_before_ms, due.task_id
    LIMIT $4";

/// What a claim sets on the tasks it leases ($2 the owner, $3 the lease's
/// end, $4 now).
const LEASE_SET: &str = "state = 'leased', lease_owner = $2, lease_token = lease_token + 1,
    lease_expires_ms = $3, attempt_started_at_ms = $4,
    first_attempt_at_ms = COALESCE(first_attempt_at_ms, $4), output_recorded = FALSE,
    timer_fired = (wake_at_ms IS NOT NULL AND wake_at_ms <= $4)";

pub(super) async fn claim<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    worker_id: &str,
    flow_types: &[String],
    max: usize,
    lease_ms: i64,
) -> TxResult<Vec<ClaimedTask>> {
    let rows = claim_fairly(tx, now, worker_id, flow_types, max, lease_ms).await?;
    finish_claim(tx, rows).await
}

/// What a claim does once it has leased its tasks: a task that waited for
/// messages gets them, and a task holding state locks takes them.
pub(super) async fn finish_claim<C: GenericClient>(
    tx: &C,
    rows: Vec<TaskRow>,
) -> TxResult<Vec<ClaimedTask>> {
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

/// The worker's poll: the fair order among every flow of `flow_types`.
async fn claim_fairly<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    worker_id: &str,
    flow_types: &[String],
    max: usize,
    lease_ms: i64,
) -> TxResult<Vec<TaskRow>> {
    let window = max.saturating_mul(4).max(FAIR_CLAIM_WINDOW) as i64;
    // More candidates than it takes: one whose flow is busy is passed over
    // for the next, not allowed to leave the claim empty.
    let fetch = max.saturating_mul(4).max(4) as i64;
    let order: Vec<i64> = query(tx, FAIR_ORDER, &[&flow_types, &now, &window, &fetch])
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if order.is_empty() {
        return Ok(Vec::new());
    }
    // Then locked, by key: a task another worker is claiming right now is
    // passed over, not waited for, and one taken since the read is
    // re-checked as no longer due.
    let mut candidates = query(
        tx,
        "SELECT task_id, flow_id, locks <> '[]' FROM tasks
         WHERE task_id = ANY($1)
           AND ((state = 'ready' AND not_before_ms <= $2) OR (state = 'waiting' AND wake_at_ms <= $2))
         FOR UPDATE SKIP LOCKED",
        &[&order, &now],
    )
    .await?;
    candidates.sort_by_key(|row| order.iter().position(|id| *id == row.get::<_, i64>(0)));
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
        &format!("UPDATE tasks SET {LEASE_SET} WHERE task_id = ANY($1) RETURNING {TASK_COLUMNS}"),
        &[&ids, &worker_id, &(now + lease_ms), &now],
    )
    .await?;
    let mut rows = leased
        .iter()
        .map(|row| decode_task(task_row(row)?))
        .collect::<Result<Vec<TaskRow>, StoreError>>()?;
    // In the fair order the candidates came in.
    rows.sort_by_key(|row| ids.iter().position(|id| *id == row.task.task_id));
    Ok(rows)
}

/// A claim made with a commit: the committing flow's next due tasks, only
/// on a sequential path (no other Step of the flow running; see the SQLite
/// backend), oldest first. One statement: within one flow the fair order is
/// the age order, and the commit already holds the flow's row, so a task
/// holding state locks needs no further check. $1 the flow, $2 the owner,
/// $3 the lease's end, $4 now, $5 how many at most; read the rows with
/// [`in_flow_rows`].
pub(super) static CLAIM_IN_FLOW: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH picked AS (
           SELECT task_id AS picked_id FROM tasks AS t
           WHERE t.flow_id = $1
             AND ((t.state = 'ready' AND t.not_before_ms <= $4)
                  OR (t.state = 'waiting' AND t.wake_at_ms <= $4))
             -- Through the flow's index: written `state || ''`, the check
             -- cannot pick the index of every lease (a scan of all of them).
             AND NOT EXISTS (SELECT 1 FROM tasks AS l
                             WHERE l.flow_id = t.flow_id AND l.state || '' = 'leased')
           ORDER BY t.not_before_ms, t.task_id
           LIMIT $5
           FOR UPDATE SKIP LOCKED)
         UPDATE tasks SET {LEASE_SET} FROM picked WHERE task_id = picked.picked_id
         RETURNING {TASK_COLUMNS}, not_before_ms"
    )
});

/// The tasks [`CLAIM_IN_FLOW`] leased, oldest first.
pub(super) fn in_flow_rows(leased: &[Row]) -> Result<Vec<TaskRow>, StoreError> {
    let mut rows = leased
        .iter()
        .map(|row| Ok((row.get::<_, i64>(18), decode_task(task_row(row)?)?)))
        .collect::<Result<Vec<(i64, TaskRow)>, StoreError>>()?;
    rows.sort_by_key(|(not_before, row)| (*not_before, row.task.task_id));
    Ok(rows.into_iter().map(|(_, row)| row).collect())
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
           (SELECT MIN(wake_at_ms) FROM tasks
            WHERE state = 'waiting' AND wake_at_ms IS NOT NULL AND flow_type = ANY($1)),
           (SELECT MIN(lease_expires_ms) FROM tasks WHERE state = 'leased' AND flow_type = ANY($1)))",
        &[&flow_types],
    )
    .await?;
    Ok(row.get(0))
}
