//! The queue's depth: tasks by state.

use deadpool_postgres::GenericClient;

use super::sql::{execute, query, TxResult};
use crate::flow::types::TaskCounts;

/// Bounds the scan on the server too: a caller that stops waiting does not
/// stop the query, and its connection would go back to the pool busy.
const STATEMENT_TIMEOUT: &str = "SET LOCAL statement_timeout = '2s'";

/// Counts in the caller's transaction (for [`STATEMENT_TIMEOUT`]).
pub(super) async fn task_counts<C: GenericClient>(client: &C) -> TxResult<TaskCounts> {
    execute(client, STATEMENT_TIMEOUT, &[]).await?;
    let rows = query(
        client,
        "SELECT state, COUNT(*) FROM tasks GROUP BY state",
        &[],
    )
    .await?;
    let mut counts = TaskCounts::default();
    for row in &rows {
        let state: String = row.get(0);
        let count: i64 = row.get(1);
        counts.add(&state, u64::try_from(count).unwrap_or(0));
    }
    Ok(counts)
}
