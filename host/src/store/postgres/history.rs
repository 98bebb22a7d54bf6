//! The Step history on PostgreSQL: one row per final attempt outcome.

use deadpool_postgres::GenericClient;

use super::sql::{execute, query, TxResult};
use crate::flow::types::StepHistoryEntry;

pub(super) async fn insert_history<C: GenericClient>(
    tx: &C,
    flow_id: &str,
    entry: &StepHistoryEntry,
) -> TxResult<()> {
    let detail = entry.detail.as_deref().filter(|d| !d.is_empty());
    execute(
        tx,
        "INSERT INTO step_history (flow_id, event_type, step_type, step_execution_id, attempt,
            at_ms, detail, started_at_ms, component)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        &[
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
    Ok(())
}

/// Entries after entry id `after`, oldest first, at most `limit`.
pub(super) async fn step_history<C: GenericClient>(
    client: &C,
    flow_id: &str,
    after: Option<i64>,
    limit: usize,
) -> TxResult<Vec<(i64, StepHistoryEntry)>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows = query(
        client,
        "SELECT event_type, step_type, step_execution_id, attempt, at_ms, detail, started_at_ms,
                component, entry_id
         FROM step_history WHERE flow_id = $1 AND entry_id > $2 ORDER BY entry_id LIMIT $3",
        &[&flow_id, &after.unwrap_or(i64::MIN), &limit],
    )
    .await?;
    Ok(rows
        .iter()
        .map(|row| {
            (
                row.get(8),
                StepHistoryEntry {
                    event_type: row.get(0),
                    step_type: row.get(1),
                    step_execution_id: row.get(2),
                    final_attempt: u32::try_from(row.get::<_, i64>(3)).unwrap_or(u32::MAX),
                    at: row.get(4),
                    detail: row.get(5),
                    started_at: row.get(6),
                    component: row.get(7),
                },
            )
        })
        .collect())
}
