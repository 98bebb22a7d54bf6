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

pub(super) async fn step_history<C: GenericClient>(
    client: &C,
    flow_id: &str,
) -> TxResult<Vec<StepHistoryEntry>> {
    let rows = query(
        client,
        "SELECT event_type, step_type, step_execution_id, attempt, at_ms, detail, started_at_ms,
                component
         FROM step_history WHERE flow_id = $1 ORDER BY entry_id",
        &[&flow_id],
    )
    .await?;
    Ok(rows
        .iter()
        .map(|row| StepHistoryEntry {
            event_type: row.get(0),
            step_type: row.get(1),
            step_execution_id: row.get(2),
            final_attempt: u32::try_from(row.get::<_, i64>(3)).unwrap_or(u32::MAX),
            at: row.get(4),
            detail: row.get(5),
            started_at: row.get(6),
            component: row.get(7),
        })
        .collect())
}
