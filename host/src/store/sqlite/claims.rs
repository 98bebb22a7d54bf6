//! Claims: which due tasks a worker leases, fairly between flows, and the
//! flow's next task that rides with a commit.

use rusqlite::{params, params_from_iter, Connection};

use super::sql::{cached_execute, cached_query_row, in_list};
use super::state::channel_messages;
use super::tasks::task_row;
use crate::flow::store::StoreError;
use crate::flow::types::{ClaimedTask, StoreMillis};
use crate::store::rows::{decode_task, TaskRow, TASK_COLUMNS};

/// Whether any task of `flow_types` could be claimed now (a cheap read that
/// spares the writer the claims that would find nothing).
pub(super) fn any_claimable(
    conn: &Connection,
    now: StoreMillis,
    flow_types: &[String],
) -> Result<bool, StoreError> {
    let sql = format!(
        "SELECT 1 FROM tasks
         WHERE flow_type IN ({})
           AND ((state = 'ready' AND not_before_ms <= ?) OR (state = 'waiting' AND wake_at_ms <= ?))
         LIMIT 1",
        in_list(flow_types.len())
    );
    let mut values: Vec<rusqlite::types::Value> =
        flow_types.iter().map(|t| t.clone().into()).collect();
    values.push(now.into());
    values.push(now.into());
    let mut stmt = conn.prepare_cached(&sql)?;
    let found = stmt.exists(params_from_iter(values))?;
    Ok(found)
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

pub(super) fn claim(
    conn: &Connection,
    now: StoreMillis,
    worker_id: &str,
    scope: ClaimScope<'_>,
    max: usize,
    lease_ms: i64,
) -> Result<Vec<ClaimedTask>, StoreError> {
    let ids = match scope {
        ClaimScope::FlowTypes(flow_types) => due_task_ids(conn, now, flow_types, max)?,
        ClaimScope::Flow(flow_id) => flow_next_task_ids(conn, now, flow_id, max)?,
    };
    let mut claimed = Vec::with_capacity(ids.len());
    for task_id in ids {
        let raw = cached_query_row(
            conn,
            &format!(
                "UPDATE tasks SET state = 'leased', lease_owner = ?2, lease_token = lease_token + 1,
                    lease_expires_ms = ?3, attempt_started_at_ms = ?4,
                    first_attempt_at_ms = COALESCE(first_attempt_at_ms, ?4), output_recorded = 0,
                    timer_fired = CASE WHEN wake_at_ms IS NOT NULL AND wake_at_ms <= ?4 THEN 1 ELSE 0 END
                 WHERE task_id = ?1 RETURNING {TASK_COLUMNS}"
            ),
            params![task_id, worker_id, now + lease_ms, now],
            task_row,
        )?;
        let TaskRow { mut task, wait, .. } = decode_task(raw)?;
        if let Some((channel, key, count)) = wait {
            let messages = channel_messages(conn, &task.flow_id, &channel, &key, count)?;
            // A timer can wake the task before the condition holds; then it
            // gets no messages.
            if messages.len() as u32 >= count {
                task.messages = messages;
            }
        }
        for name in &task.locks {
            cached_execute(
                conn,
                "INSERT OR IGNORE INTO state_locks (flow_id, name, task_id) VALUES (?1, ?2, ?3)",
                params![task.flow_id, name, task_id],
            )?;
        }
        claimed.push(task);
    }
    Ok(claimed)
}

/// The oldest due tasks of `flow_types`, fair between flows: among the
/// oldest due tasks (a window of at least FAIR_CLAIM_WINDOW), a task goes
/// first when its flow runs fewer Steps, counting those this claim takes
/// before it (its rank within its flow), so that one flow's backlog (a
/// fan-out of hundreds of tool calls) delays another flow's next Step by a
/// free slot, not by the backlog.
fn due_task_ids(
    conn: &Connection,
    now: StoreMillis,
    flow_types: &[String],
    max: usize,
) -> Result<Vec<i64>, StoreError> {
    let sql = due_tasks_sql(flow_types.len());
    let mut values: Vec<rusqlite::types::Value> =
        flow_types.iter().map(|t| t.clone().into()).collect();
    values.push(now.into());
    values.push(now.into());
    values.push((max.saturating_mul(4).max(FAIR_CLAIM_WINDOW) as i64).into());
    values.push((max as i64).into());
    let mut stmt = conn.prepare_cached(&sql)?;
    let ids = stmt
        .query_map(params_from_iter(values), |row| row.get::<_, i64>(0))?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ids)
}

/// The fair claim's query for `types` flow types: the flow types, `now`
/// twice, the window and the limit are its parameters.
fn due_tasks_sql(types: usize) -> String {
    format!(
        "SELECT task_id FROM (
           SELECT task_id, flow_id, not_before_ms,
                  ROW_NUMBER() OVER (PARTITION BY flow_id ORDER BY not_before_ms, task_id) AS rank
           FROM (
             SELECT task_id, flow_id, not_before_ms FROM tasks AS t
             WHERE flow_type IN ({})
               AND ((state = 'ready' AND not_before_ms <= ?) OR (state = 'waiting' AND wake_at_ms <= ?))
             ORDER BY not_before_ms, task_id LIMIT ?)) AS due
         ORDER BY rank + (SELECT COUNT(*) FROM tasks AS l WHERE l.flow_id = due.flow_id AND l.state = 'leased'),
                  not_before_ms, task_id
         LIMIT ?",
        in_list(types)
    )
}

/// The due tasks of one flow, oldest first, when none of its tasks is
/// leased: a flow's next Steps ride with its commit only when the commit
/// ends the last Step it ran (a sequential Step, or the one that starts a
/// fan-out, whose first share rides along: the worker asks for at most a
/// quarter of its slots, and only for free ones). A flow already running
/// others gets its next ones through the fair claim, so that it cannot keep
/// a worker's slots from other flows by committing into them.
///
/// `INDEXED BY` because, without statistics, SQLite may pick the global
/// per-state indexes and walk every due task of every flow (a window
/// function and three sorts on top) to find this flow's: 130 µs a commit in
/// `dexa bench turn`, where the flow's own rows take a few.
fn flow_next_task_ids(
    conn: &Connection,
    now: StoreMillis,
    flow_id: &str,
    max: usize,
) -> Result<Vec<i64>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT task_id FROM tasks INDEXED BY tasks_by_flow_state
         WHERE flow_id = ?1
           AND ((state = 'ready' AND not_before_ms <= ?2) OR (state = 'waiting' AND wake_at_ms <= ?2))
           AND NOT EXISTS (SELECT 1 FROM tasks WHERE flow_id = ?1 AND state = 'leased')
         ORDER BY not_before_ms, task_id LIMIT ?3",
    )?;
    let ids = stmt
        .query_map(params![flow_id, now, max as i64], |row| {
            row.get::<_, i64>(0)
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each line of SQLite's plan for `sql` run with `values`.
    fn plan(conn: &Connection, sql: &str, values: Vec<rusqlite::types::Value>) -> Vec<String> {
        let mut stmt = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .unwrap_or_else(|err| panic!("{err}"));
        let lines = stmt
            .query_map(params_from_iter(values), |row| row.get::<_, String>(3))
            .unwrap_or_else(|err| panic!("{err}"))
            .collect::<Result<Vec<_>, _>>()
            .unwrap_or_else(|err| panic!("{err}"));
        lines
    }

    /// The fair claim finds due tasks through the ready and waiting tasks'
    /// own indexes: it never walks the table nor the leased tasks.
    #[test]
    fn a_claim_searches_only_the_due_states_indexes() {
        // A connection made as the store makes its own: the planner's
        // stability guarantee is on.
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
        let options = super::super::SqliteOptions {
            synchronous: super::super::Synchronous::Normal,
        };
        let mut conn = super::super::connection::connect(&dir.path().join("plan.db"), &options)
            .unwrap_or_else(|err| panic!("{err}"));
        super::super::schema::migrate(&mut conn).unwrap_or_else(|err| panic!("{err}"));
        let values = vec![
            "T".to_string().into(),
            5_i64.into(),
            5_i64.into(),
            256_i64.into(),
            8_i64.into(),
        ];
        let lines = plan(&conn, &due_tasks_sql(1), values);
        let text = lines.join("\n");
        assert!(text.contains("USING INDEX tasks_ready_at"), "{text}");
        assert!(text.contains("USING INDEX tasks_waiting_until"), "{text}");
        assert!(
            !lines.iter().any(|line| line.starts_with("SCAN t")),
            "no scan of the tasks table:\n{text}"
        );
    }
}
