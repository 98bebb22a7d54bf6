//! The `step_history` table: what each Step attempt did, in order.

use rusqlite::{params, Connection};

use super::sql::cached_execute;
use crate::flow::store::StoreError;
use crate::flow::types::StepHistoryEntry;

pub(super) fn insert_history(
    conn: &Connection,
    flow_id: &str,
    entry: &StepHistoryEntry,
) -> Result<(), StoreError> {
    cached_execute(conn,
        "INSERT INTO step_history (flow_id, event_type, step_type, step_execution_id, attempt, at_ms, detail, started_at_ms, component)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            flow_id,
            entry.event_type,
            entry.step_type,
            entry.step_execution_id,
            entry.final_attempt,
            entry.at,
            entry.detail.as_deref().filter(|d| !d.is_empty()),
            entry.started_at,
            entry.component,
        ],
    )?;
    Ok(())
}

/// Entries after entry id `after`, oldest first, at most `limit`.
pub(super) fn step_history(
    conn: &Connection,
    flow_id: &str,
    after: Option<i64>,
    limit: usize,
) -> Result<Vec<(i64, StepHistoryEntry)>, StoreError> {
    let mut stmt = conn.prepare(
        "SELECT event_type, step_type, step_execution_id, attempt, at_ms, detail, started_at_ms, component,
                entry_id
         FROM step_history WHERE flow_id = ?1 AND entry_id > ?2 ORDER BY entry_id LIMIT ?3",
    )?;
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = stmt
        .query_map(params![flow_id, after.unwrap_or(i64::MIN), limit], |row| {
            Ok((
                row.get(8)?,
                StepHistoryEntry {
                    event_type: row.get(0)?,
                    step_type: row.get(1)?,
                    step_execution_id: row.get(2)?,
                    final_attempt: row.get(3)?,
                    at: row.get(4)?,
                    detail: row.get(5)?,
                    started_at: row.get(6)?,
                    component: row.get(7)?,
                },
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}
