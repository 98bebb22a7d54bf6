//! The `tasks` and `state_locks` tables: inserting and dropping tasks,
//! claiming them under a lease, renewing and checking leases, committing or
//! failing an attempt, and finding expired leases and the next due time.

use rusqlite::{params, params_from_iter, Connection, OptionalExtension, Row};

use super::history::insert_history;
use super::sql::{backend, cached_execute, cached_query_row, exists, in_list};
use super::state::{apply_write, wake_waiters};
use super::streams;
use crate::flow::store::{AttemptFailure, ExpiredLease, FailureAction, StepCommit, StoreError};
use crate::flow::types::{NewTask, StoreMillis, TakenTask};
use crate::store::rows::{decode_task, TaskRow, TaskRowRaw, TASK_COLUMNS};
use crate::store::write_plan::WritePlan;

/// Inserts a task; a task whose channel condition already holds is ready.
pub(super) fn insert_task(
    conn: &Connection,
    flow_id: &str,
    flow_type: &str,
    task: &NewTask,
) -> Result<i64, StoreError> {
    let channel = task.wait.as_ref().and_then(|w| w.channel.as_ref());
    let wake_at = task.wait.as_ref().and_then(|w| w.timer_at);
    let state = if task.wait.is_some() {
        "waiting"
    } else {
        "ready"
    };
    let policy = serde_json::to_string(&task.policy).map_err(backend)?;
    let locks = serde_json::to_string(&task.locks).map_err(backend)?;
    cached_execute(
        conn,
        "INSERT INTO tasks (flow_id, flow_type, step_type, input, state, attempt, not_before_ms,
            wait_channel, wait_key, wait_count, wake_at_ms, policy, failure_route, failure, locks)
         VALUES (?1, ?2, ?3, ?4, ?5, 1, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
        params![
            flow_id,
            flow_type,
            task.step_type,
            task.input.to_string(),
            state,
            task.not_before,
            channel.map(|c| c.channel.as_str()),
            channel.map(|c| c.key.as_str()),
            channel.map(|c| c.count),
            wake_at,
            policy,
            task.failure_route,
            task.failure,
            locks,
        ],
    )?;
    let task_id = conn.last_insert_rowid();
    if let Some(channel) = channel {
        wake_waiters(conn, flow_id, &channel.channel, &channel.key)?;
    }
    Ok(task_id)
}

/// The flow's tasks as [`TakenTask`]s, oldest first.
pub(super) fn flow_tasks(conn: &Connection, flow_id: &str) -> Result<Vec<TakenTask>, StoreError> {
    let mut stmt = conn.prepare_cached(
        "SELECT step_type, input, state, output_recorded, attempt, failure FROM tasks
         WHERE flow_id = ?1 ORDER BY task_id",
    )?;
    let rows = stmt
        .query_map(params![flow_id], |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, String>(1)?,
                row.get::<_, String>(2)?,
                row.get::<_, bool>(3)?,
                row.get::<_, u32>(4)?,
                row.get::<_, Option<String>>(5)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    rows.into_iter()
        .map(
            |(step_type, input, state, output_recorded, attempt, failure)| {
                Ok(TakenTask {
                    input: serde_json::from_str(&input)
                        .map_err(|err| StoreError::Corrupt(format!("task input: {err}")))?,
                    step_type,
                    leased: state == "leased",
                    output_recorded,
                    attempt,
                    failure,
                })
            },
        )
        .collect()
}

/// Whether the lease `(task_id, lease_token)` stands.
pub(super) fn lease_held(
    conn: &Connection,
    task_id: i64,
    lease_token: i64,
) -> Result<bool, StoreError> {
    exists(
        conn,
        "SELECT 1 FROM tasks WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'",
        params![task_id, lease_token],
    )
}

/// Counts a take of `flow_id`'s tasks, for other processes' watches.
pub(super) fn count_revocation(conn: &Connection, flow_id: &str) -> Result<(), StoreError> {
    cached_execute(
        conn,
        "INSERT INTO flow_revocations (flow_id, seq) VALUES (?1, 1)
         ON CONFLICT (flow_id) DO UPDATE SET seq = seq + 1",
        params![flow_id],
    )?;
    Ok(())
}

pub(super) fn drop_tasks(conn: &Connection, flow_id: &str) -> Result<(), StoreError> {
    cached_execute(
        conn,
        "DELETE FROM state_locks WHERE flow_id = ?1",
        params![flow_id],
    )?;
    cached_execute(
        conn,
        "DELETE FROM tasks WHERE flow_id = ?1",
        params![flow_id],
    )?;
    Ok(())
}

pub(super) fn task_row(row: &Row<'_>) -> rusqlite::Result<TaskRowRaw> {
    let channel: Option<String> = row.get(14)?;
    let wait = match channel {
        Some(channel) => Some((channel, row.get::<_, String>(15)?, row.get::<_, u32>(16)?)),
        None => None,
    };
    Ok(TaskRowRaw {
        task_id: row.get(0)?,
        flow_id: row.get(1)?,
        flow_type: row.get(2)?,
        step_type: row.get(3)?,
        input: row.get(4)?,
        attempt: row.get(5)?,
        lease_token: row.get(6)?,
        policy: row.get(7)?,
        failure_route: row.get(8)?,
        failure: row.get(9)?,
        locks: row.get(10)?,
        timer_fired: row.get::<_, i64>(11)? != 0,
        first_attempt_at: row.get::<_, Option<i64>>(12)?.unwrap_or(0),
        attempt_started_at: row.get::<_, Option<i64>>(13)?.unwrap_or(0),
        wait,
        output_recorded: row.get::<_, i64>(17)? != 0,
    })
}

fn load_task(conn: &Connection, task_id: i64) -> Result<TaskRow, StoreError> {
    let raw = cached_query_row(
        conn,
        &format!("SELECT {TASK_COLUMNS} FROM tasks WHERE task_id = ?1"),
        params![task_id],
        task_row,
    )?;
    decode_task(raw)
}

/// Marks that the leased attempt produced output, fenced by its token and by
/// a lease that has not run out: once it has, the reaper may be handing the
/// same attempt to another worker, and "output recorded" must then be
/// refused, never raced (the redelivery re-checks it in its own statement).
pub(super) fn record_output(
    conn: &Connection,
    now: StoreMillis,
    task_id: i64,
    lease_token: i64,
) -> Result<(), StoreError> {
    let updated = cached_execute(
        conn,
        "UPDATE tasks SET output_recorded = 1
             WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'
               AND lease_expires_ms > ?3",
        params![task_id, lease_token, now],
    )?;
    if updated == 0 {
        return Err(StoreError::StaleLease { task_id });
    }
    Ok(())
}

/// Extends the leases `worker_id` still holds; returns those it lost.
pub(super) fn renew_leases(
    tx: &Connection,
    now: StoreMillis,
    worker_id: &str,
    held: Vec<(i64, i64)>,
    lease_ms: i64,
) -> Result<Vec<(i64, i64)>, StoreError> {
    let mut lost = Vec::new();
    let mut stmt = tx.prepare_cached(
        "UPDATE tasks SET lease_expires_ms = ?1
         WHERE task_id = ?2 AND lease_token = ?3 AND state = 'leased' AND lease_owner = ?4",
    )?;
    for (task_id, token) in held {
        let renewed = stmt.execute(params![now + lease_ms, task_id, token, worker_id])?;
        if renewed == 0 {
            lost.push((task_id, token));
        }
    }
    Ok(lost)
}

/// Refuses unless `task_id` is leased under `lease_token` (and, for the
/// reaper, its lease has run out by `expired_by`).
pub(super) fn check_lease(
    conn: &Connection,
    task_id: i64,
    lease_token: i64,
    expired_by: Option<StoreMillis>,
) -> Result<(), StoreError> {
    let held = match expired_by {
        None => exists(
            conn,
            "SELECT 1 FROM tasks WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'",
            params![task_id, lease_token],
        )?,
        Some(now) => exists(
            conn,
            "SELECT 1 FROM tasks WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'
               AND lease_expires_ms <= ?3",
            params![task_id, lease_token, now],
        )?,
    };
    if held {
        Ok(())
    } else {
        Err(StoreError::StaleLease { task_id })
    }
}

pub(super) fn commit_step(
    conn: &Connection,
    now: StoreMillis,
    commit: StepCommit,
) -> Result<(), StoreError> {
    let flow_id = &commit.flow_id;
    // Fences, finds the flow type and removes the task in one statement.
    let flow_type: Option<String> = cached_query_row(
        conn,
        "DELETE FROM tasks WHERE task_id = ?1 AND lease_token = ?2 AND state = 'leased'
         RETURNING flow_type",
        params![commit.task_id, commit.lease_token],
        |row| row.get(0),
    )
    .optional()?;
    let Some(flow_type) = flow_type else {
        return Err(StoreError::StaleLease {
            task_id: commit.task_id,
        });
    };
    for message_id in &commit.consumed {
        let deleted = cached_execute(
            conn,
            "DELETE FROM channel_messages WHERE message_id = ?1",
            params![message_id],
        )?;
        if deleted == 0 {
            return Err(StoreError::Conflict(format!(
                "channel message {message_id} was already consumed"
            )));
        }
    }
    let plan = WritePlan::of(&commit.writes);
    for write in plan.others {
        apply_write(conn, now, flow_id, write)?;
    }
    for (stream, entries) in &plan.appends {
        streams::append_fitting(conn, now, flow_id, stream, entries)?;
    }
    insert_history(conn, flow_id, &commit.history)?;
    cached_execute(
        conn,
        "DELETE FROM state_locks WHERE task_id = ?1",
        params![commit.task_id],
    )?;
    if commit.complete_flow {
        drop_tasks(conn, flow_id)?;
    } else {
        for task in &commit.next {
            insert_task(conn, flow_id, &flow_type, task)?;
        }
    }
    // A flow with a next Step is still running; only check when it may be done.
    let done = commit.complete_flow
        || (commit.next.is_empty()
            && !exists(
                conn,
                "SELECT 1 FROM tasks WHERE flow_id = ?1",
                params![flow_id],
            )?);
    if done {
        cached_execute(
            conn,
            "UPDATE flows SET status = 'completed', updated_at_ms = ?2
             WHERE flow_id = ?1 AND status = 'running'",
            params![flow_id, now],
        )?;
    }
    Ok(())
}

/// Ends a failed attempt: a retry, a redelivery of the same attempt, or
/// giving up (to the failure route, or failing the flow).
pub(super) fn fail_attempt(
    tx: &Connection,
    now: StoreMillis,
    failure: AttemptFailure,
) -> Result<(), StoreError> {
    check_lease(
        tx,
        failure.task_id,
        failure.lease_token,
        failure.require_expired.then_some(now),
    )?;
    insert_history(tx, &failure.flow_id, &failure.history)?;
    cached_execute(
        tx,
        "DELETE FROM state_locks WHERE task_id = ?1",
        params![failure.task_id],
    )?;
    match failure.action {
        FailureAction::Retry {
            attempt,
            not_before,
        } => {
            cached_execute(
                tx,
                "UPDATE tasks SET state = 'ready', attempt = ?2, not_before_ms = ?3,
                 lease_owner = NULL, lease_expires_ms = NULL, output_recorded = 0
                 WHERE task_id = ?1",
                params![failure.task_id, attempt, not_before],
            )?;
        }
        FailureAction::Redeliver => {
            // The same attempt again only while it provably produced
            // nothing: checked in this statement, so that a "started"
            // write committed after the reaper looked wins, and the
            // whole failure (history included) is rolled back.
            let redelivered = cached_execute(
                tx,
                "UPDATE tasks SET state = 'ready', lease_owner = NULL, lease_expires_ms = NULL
                 WHERE task_id = ?1 AND output_recorded = 0",
                params![failure.task_id],
            )?;
            if redelivered == 0 {
                return Err(StoreError::OutputRecorded {
                    task_id: failure.task_id,
                });
            }
        }
        FailureAction::GiveUp { route, flow_error } => {
            cached_execute(
                tx,
                "DELETE FROM tasks WHERE task_id = ?1",
                params![failure.task_id],
            )?;
            let flow_type: String = cached_query_row(
                tx,
                "SELECT flow_type FROM flows WHERE flow_id = ?1",
                params![failure.flow_id],
                |row| row.get(0),
            )?;
            match route {
                Some(route) => {
                    insert_task(tx, &failure.flow_id, &flow_type, &route)?;
                }
                None => {
                    cached_execute(
                        tx,
                        "UPDATE flows SET status = 'failed', error = ?2, updated_at_ms = ?3
                         WHERE flow_id = ?1",
                        params![failure.flow_id, flow_error, now],
                    )?;
                    drop_tasks(tx, &failure.flow_id)?;
                }
            }
        }
    }
    Ok(())
}

pub(super) fn expired_leases(
    conn: &Connection,
    now: StoreMillis,
    flow_types: &[String],
    limit: usize,
) -> Result<Vec<ExpiredLease>, StoreError> {
    let sql = format!(
        "SELECT task_id FROM tasks WHERE state = 'leased' AND lease_expires_ms <= ?
           AND flow_type IN ({}) ORDER BY lease_expires_ms LIMIT ?",
        in_list(flow_types.len())
    );
    let mut values: Vec<rusqlite::types::Value> = vec![now.into()];
    values.extend(
        flow_types
            .iter()
            .map(|t| rusqlite::types::Value::from(t.clone())),
    );
    values.push((limit as i64).into());
    let ids = {
        let mut stmt = conn.prepare(&sql)?;
        let ids = stmt
            .query_map(params_from_iter(values), |row| row.get::<_, i64>(0))?
            .collect::<Result<Vec<_>, _>>()?;
        ids
    };
    ids.into_iter()
        .map(|task_id| {
            let row = load_task(conn, task_id)?;
            Ok(ExpiredLease {
                task: row.task,
                output_recorded: row.output_recorded,
            })
        })
        .collect()
}

/// When the next task of `flow_types` is due: ready, woken by its timer, or
/// its lease expired.
pub(super) fn next_due(
    conn: &Connection,
    flow_types: &[String],
) -> Result<Option<StoreMillis>, StoreError> {
    let list = in_list(flow_types.len());
    let sql = format!(
        "SELECT MIN(due) FROM (
           SELECT MIN(not_before_ms) AS due FROM tasks WHERE state = 'ready' AND flow_type IN ({list})
           UNION ALL
           SELECT MIN(wake_at_ms) FROM tasks WHERE state = 'waiting' AND flow_type IN ({list})
           UNION ALL
           SELECT MIN(lease_expires_ms) FROM tasks WHERE state = 'leased' AND flow_type IN ({list}))"
    );
    let params: Vec<&String> = flow_types
        .iter()
        .chain(flow_types)
        .chain(flow_types)
        .collect();
    Ok(cached_query_row(
        conn,
        &sql,
        params_from_iter(params),
        |row| row.get(0),
    )?)
}
