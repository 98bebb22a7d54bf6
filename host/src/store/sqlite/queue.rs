//! The queue's depth: tasks by state.

use rusqlite::Connection;

use super::sql::backend;
use crate::flow::store::StoreError;
use crate::flow::types::TaskCounts;

pub(super) fn task_counts(conn: &Connection) -> Result<TaskCounts, StoreError> {
    let mut statement = conn
        .prepare_cached("SELECT state, COUNT(*) FROM tasks GROUP BY state")
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
