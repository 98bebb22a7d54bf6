//! The queue's depth: tasks by state.

use rusqlite::Connection;

use super::sql::backend;
use crate::flow::store::StoreError;
use crate::flow::types::TaskCounts;

pub(super) fn task_counts(conn: &Connection) -> Result<TaskCounts, StoreError> {
    let mut statement = conn
        // One count per state, each over that state's partial index; a
        // GROUP BY would read every task through the flow index and sort.
        .prepare_cached(
            "SELECT 'waiting', COUNT(*) FROM tasks WHERE state = 'waiting'
             UNION ALL SELECT 'ready', COUNT(*) FROM tasks WHERE state = 'ready'
             UNION ALL SELECT 'leased', COUNT(*) FROM tasks WHERE state = 'leased'",
        )
        .map_err(backend)?;
    let rows = statement
        .query_map([], |row| {
            Ok((row.get::<_, String>(0)?, row.get::<_, i64>(1)?))
        })
        .map_err(backend)?;
    let mut counts = TaskCounts::default();
    for row in rows {
        let (state, count) = row.map_err(backend)?;
        counts.add(&state, u64::try_from(count).unwrap_or(0));
    }
    Ok(counts)
}
