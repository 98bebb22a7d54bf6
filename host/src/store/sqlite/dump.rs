//! Reading every table out, for `dexa store copy` (`store/copy.rs`).

use rusqlite::types::ValueRef;
use tokio::sync::mpsc::Sender;

use super::connection::open_reader;
use super::SqliteStore;
use crate::flow::StoreError;
use crate::store::copy::{Batch, Cell, Kind, TableSpec, BATCH_BYTES, BATCH_ROWS, TABLES};

impl SqliteStore {
    /// Sends every table's rows in batches, all from one snapshot, then each
    /// table's count. Blocking: run it on a blocking thread. Stops early,
    /// without error, when the receiver is gone (the target failed).
    pub fn dump(&self, batches: Sender<Batch>) -> Result<(), StoreError> {
        let conn = open_reader(&self.inner.path, &self.inner.options)?;
        let tx = conn.unchecked_transaction()?;
        for spec in TABLES {
            let columns: Vec<&str> = spec.columns.iter().map(|(name, _)| *name).collect();
            let sql = format!("SELECT {} FROM {}", columns.join(", "), spec.name);
            let mut stmt = tx.prepare(&sql)?;
            let mut rows = stmt.query([])?;
            let mut batch = Vec::with_capacity(BATCH_ROWS);
            let mut bytes = 0usize;
            let mut count = 0u64;
            while let Some(row) = rows.next()? {
                let mut cells = Vec::with_capacity(spec.columns.len());
                for (index, (column, kind)) in spec.columns.iter().enumerate() {
                    let cell = cell(spec, column, *kind, row.get_ref(index)?)?;
                    bytes += match &cell {
                        Cell::Text(text) => text.len(),
                        Cell::Bytes(blob) => blob.len(),
                        _ => 8,
                    };
                    cells.push(cell);
                }
                batch.push(cells);
                count += 1;
                // By rows and by bytes: a table of big components must not
                // become one message of a gigabyte.
                if batch.len() == BATCH_ROWS || bytes >= BATCH_BYTES {
                    bytes = 0;
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(BATCH_ROWS));
                    if batches.blocking_send(Batch::Rows(spec, full)).is_err() {
                        return Ok(());
                    }
                }
            }
            if !batch.is_empty() && batches.blocking_send(Batch::Rows(spec, batch)).is_err() {
                return Ok(());
            }
            if batches.blocking_send(Batch::Done(spec, count)).is_err() {
                return Ok(());
            }
        }
        tx.finish()?;
        Ok(())
    }
}

/// One value as the target stores it; a value of the wrong type (which this
/// store never writes) is named, not guessed at.
fn cell(
    spec: &TableSpec,
    column: &str,
    kind: Kind,
    value: ValueRef<'_>,
) -> Result<Cell, StoreError> {
    let wrong = |what: &str| {
        StoreError::Corrupt(format!("{}.{column} holds {what}, not {kind:?}", spec.name))
    };
    Ok(match (kind, value) {
        (_, ValueRef::Null) => Cell::Null,
        (Kind::Int, ValueRef::Integer(v)) => Cell::Int(v),
        (Kind::Bool, ValueRef::Integer(v)) => Cell::Bool(v != 0),
        (Kind::Text, ValueRef::Text(bytes)) => Cell::Text(
            std::str::from_utf8(bytes)
                .map_err(|_| wrong("text that is not UTF-8"))?
                .to_string(),
        ),
        (Kind::Bytes, ValueRef::Blob(bytes)) => Cell::Bytes(bytes.to_vec()),
        (_, ValueRef::Integer(_)) => return Err(wrong("an integer")),
        (_, ValueRef::Real(_)) => return Err(wrong("a real")),
        (_, ValueRef::Text(_)) => return Err(wrong("text")),
        (_, ValueRef::Blob(_)) => return Err(wrong("a blob")),
    })
}
