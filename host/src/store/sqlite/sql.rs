//! The SQL plumbing every table's code shares: rusqlite's errors as
//! [`StoreError`]s, the statement cache, and small query helpers.

use rusqlite::{Connection, OptionalExtension};

use crate::flow::store::StoreError;
use crate::flow::types::StoreMillis;

/// Any rusqlite error is a backend error (its message kept), so that `?`
/// works on rusqlite results in code that returns [`StoreError`].
impl From<rusqlite::Error> for StoreError {
    fn from(err: rusqlite::Error) -> Self {
        StoreError::Backend(err.to_string())
    }
}

/// A backend error from anything printable (for errors that are not
/// rusqlite's, or where the caller's error type is not [`StoreError`]).
pub(crate) fn backend(err: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(err.to_string())
}

pub(crate) fn now_millis() -> StoreMillis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `execute` through the connection's statement cache.
pub(crate) fn cached_execute(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute(params)
}

/// `query_row` through the connection's statement cache.
pub(crate) fn cached_query_row<T>(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
    f: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    conn.prepare_cached(sql)?.query_row(params, f)
}

/// Whether a row exists (helper for `OptionalExtension` queries).
pub(crate) fn exists(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<bool, StoreError> {
    let found = cached_query_row(conn, sql, params, |_| Ok(())).optional()?;
    Ok(found.is_some())
}

/// `?,?,…` for an `IN` list of `count` values.
pub(crate) fn in_list(count: usize) -> String {
    vec!["?"; count].join(",")
}
