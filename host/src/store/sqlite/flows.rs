//! The `flows` table: creating, reading, listing and stopping flows.

use rusqlite::{params, Connection, OptionalExtension};

use super::sql::{cached_execute, cached_query_row};
use super::tasks;
use crate::flow::store::StoreError;
use crate::flow::types::{FlowCursor, FlowInfo, NewTask, StoreMillis};
use crate::store::rows::{to_flow_info, FlowRowRaw, FLOW_COLUMNS};

fn flow_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<FlowRowRaw> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        row.get(3)?,
        row.get(4)?,
        row.get(5)?,
    ))
}

/// Creates a running flow with its first task.
pub(super) fn create_flow(
    tx: &Connection,
    now: StoreMillis,
    flow_id: String,
    flow_type: &str,
    first: &NewTask,
) -> Result<(), StoreError> {
    let inserted = cached_execute(
        tx,
        "INSERT INTO flows (flow_id, flow_type, status, created_at_ms, updated_at_ms)
             VALUES (?1, ?2, 'running', ?3, ?3) ON CONFLICT (flow_id) DO NOTHING",
        params![flow_id, flow_type, now],
    )?;
    if inserted == 0 {
        return Err(StoreError::FlowExists { flow_id });
    }
    tasks::insert_task(tx, &flow_id, flow_type, first)?;
    Ok(())
}

pub(super) fn flow_info(conn: &Connection, flow_id: &str) -> Result<Option<FlowInfo>, StoreError> {
    let row = cached_query_row(
        conn,
        &format!("SELECT {FLOW_COLUMNS} FROM flows WHERE flow_id = ?1"),
        params![flow_id],
        flow_row,
    )
    .optional()?;
    row.map(to_flow_info).transpose()
}

pub(super) fn list_flows(
    conn: &Connection,
    flow_type: Option<&str>,
    after: Option<&FlowCursor>,
    limit: usize,
) -> Result<Vec<FlowInfo>, StoreError> {
    let mut stmt = conn.prepare(&format!(
        "SELECT {FLOW_COLUMNS} FROM flows WHERE (?1 IS NULL OR flow_type = ?1)
           AND (?3 IS NULL OR created_at_ms < ?3 OR (created_at_ms = ?3 AND flow_id > ?4))
         ORDER BY created_at_ms DESC, flow_id LIMIT ?2"
    ))?;
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let (created, id) = match after {
        Some(cursor) => (Some(cursor.created_at), Some(cursor.flow_id.as_str())),
        None => (None, None),
    };
    let rows = stmt
        .query_map(params![flow_type, limit, created, id], flow_row)?
        .collect::<Result<Vec<_>, _>>()?;
    rows.into_iter().map(to_flow_info).collect()
}

/// Stops a running flow and drops its tasks; false when it was not running.
pub(super) fn stop_flow(
    tx: &Connection,
    now: StoreMillis,
    flow_id: &str,
) -> Result<bool, StoreError> {
    let stopped = cached_execute(
        tx,
        "UPDATE flows SET status = 'stopped', updated_at_ms = ?2
             WHERE flow_id = ?1 AND status = 'running'",
        params![flow_id, now],
    )?;
    if stopped > 0 {
        tasks::drop_tasks(tx, flow_id)?;
        tasks::count_revocation(tx, flow_id)?;
    }
    Ok(stopped > 0)
}
