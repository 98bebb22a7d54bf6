//! The queue's depth: tasks by state.

use deadpool_postgres::GenericClient;

use super::sql::{query, TxResult};
use crate::flow::types::TaskCounts;

pub(super) async fn task_counts<C: GenericClient>(client: &C) -> TxResult<TaskCounts> {
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
