//! Flows on PostgreSQL: create, read, list and stop.

use deadpool_postgres::GenericClient;

use super::sql::{execute, query, query_opt, TxResult};
use crate::flow::store::StoreError;
use crate::flow::types::{FlowCursor, FlowInfo, NewTask, StoreMillis};
use crate::store::rows::{to_flow_info, FLOW_COLUMNS};

fn flow_row(row: &tokio_postgres::Row) -> Result<FlowInfo, StoreError> {
    to_flow_info((
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
    ))
}

pub(super) async fn create_flow<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    flow_id: &str,
    flow_type: &str,
    first: &NewTask,
) -> TxResult<()> {
    // An RPC on a flow not created yet locks its name (there is no row to
    // lock): the two apply one after the other.
    super::tasks::lock_flow_or_its_name(tx, flow_id).await?;
    let inserted = execute(
        tx,
        "INSERT INTO flows (flow_id, flow_type, status, created_at_ms, updated_at_ms)
             VALUES ($1, $2, 'running', $3, $3) ON CONFLICT (flow_id) DO NOTHING",
        &[&flow_id, &flow_type, &now],
    )
    .await?;
    if inserted == 0 {
        return Err(StoreError::FlowExists {
            flow_id: flow_id.to_string(),
        }
        .into());
    }
    super::tasks::insert_task(tx, flow_id, first).await?;
    Ok(())
}

pub(super) async fn flow_info<C: GenericClient>(
    client: &C,
    flow_id: &str,
) -> TxResult<Option<FlowInfo>> {
    let row = query_opt(
        client,
        &format!("SELECT {FLOW_COLUMNS} FROM flows WHERE flow_id = $1"),
        &[&flow_id],
    )
    .await?;
    Ok(row.as_ref().map(flow_row).transpose()?)
}

pub(super) async fn list_flows<C: GenericClient>(
    client: &C,
    flow_type: Option<&str>,
    after: Option<&FlowCursor>,
    limit: usize,
) -> TxResult<Vec<FlowInfo>> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let created = after.map(|cursor| cursor.created_at);
    let id = after.map(|cursor| cursor.flow_id.as_str());
    let rows = query(
        client,
        &format!(
            "SELECT {FLOW_COLUMNS} FROM flows WHERE ($1::text IS NULL OR flow_type = $1)
               AND ($3::bigint IS NULL OR created_at_ms < $3
                    OR (created_at_ms = $3 AND flow_id > $4::text))
             ORDER BY created_at_ms DESC, flow_id LIMIT $2"
        ),
        &[&flow_type, &limit, &created, &id],
    )
    .await?;
    Ok(rows.iter().map(flow_row).collect::<Result<_, _>>()?)
}

/// Stops a running flow and drops its tasks; false when it was not running.
pub(super) async fn stop_flow<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    flow_id: &str,
) -> TxResult<bool> {
    let stopped = execute(
        tx,
        "UPDATE flows SET status = 'stopped', updated_at_ms = $2
             WHERE flow_id = $1 AND status = 'running'",
        &[&flow_id, &now],
    )
    .await?;
    if stopped > 0 {
        super::tasks::drop_tasks(tx, flow_id).await?;
    }
    Ok(stopped > 0)
}

/// Fails a flow with `error` and drops its tasks.
pub(super) async fn fail_flow<C: GenericClient>(
    tx: &C,
    now: StoreMillis,
    flow_id: &str,
    error: &str,
) -> TxResult<()> {
    execute(
        tx,
        "UPDATE flows SET status = 'failed', error = $2, updated_at_ms = $3 WHERE flow_id = $1",
        &[&flow_id, &error, &now],
    )
    .await?;
    super::tasks::drop_tasks(tx, flow_id).await
}
