//! Writing a copied store in, for `dexa store copy` (`store/copy.rs`).

use std::error::Error;

use bytes::BytesMut;
use tokio::sync::mpsc::Receiver;
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};

use super::sql::query_one;
use super::PostgresStore;
use crate::flow::StoreError;
use crate::store::copy::{Batch, Cell, CopyError, CopyReport, TABLES};

impl ToSql for Cell {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
        match self {
            Cell::Null => Ok(IsNull::Yes),
            Cell::Int(value) => value.to_sql(ty, out),
            Cell::Text(value) => value.to_sql(ty, out),
            Cell::Bytes(value) => value.to_sql(ty, out),
            Cell::Bool(value) => value.to_sql(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        <i64 as ToSql>::accepts(ty)
            || <String as ToSql>::accepts(ty)
            || <Vec<u8> as ToSql>::accepts(ty)
            || <bool as ToSql>::accepts(ty)
    }

    to_sql_checked!();
}

impl PostgresStore {
    /// Writes the batches into this store in one transaction (see
    /// `store/copy.rs` for the rules).
    pub(crate) async fn load(
        &self,
        mut batches: Receiver<Batch>,
        replace: bool,
        progress: &(dyn Fn(&str, u64) + Sync),
    ) -> Result<CopyReport, CopyError> {
        let mut client = self.client().await.map_err(StoreError::from)?;
        let tx = client.transaction().await.map_err(StoreError::from)?;
        let mut filled = Vec::new();
        for spec in TABLES {
            let any: bool = tx
                .query_one(&format!("SELECT EXISTS (SELECT 1 FROM {})", spec.name), &[])
                .await
                .map_err(StoreError::from)?
                .get(0);
            if any {
                filled.push(spec.name);
            }
        }
        if !filled.is_empty() {
            if !replace {
                return Err(CopyError::TargetNotEmpty(format!(
                    "it has rows in {}",
                    filled.join(", ")
                )));
            }
            let names: Vec<&str> = TABLES.iter().map(|spec| spec.name).collect();
            tx.batch_execute(&format!("TRUNCATE {} RESTART IDENTITY", names.join(", ")))
                .await
                .map_err(StoreError::from)?;
        }
        let mut report = CopyReport::default();
        while let Some(batch) = batches.recv().await {
            match batch {
                Batch::Rows(spec, rows) => {
                    if rows.is_empty() {
                        continue;
                    }
                    let width = spec.columns.len();
                    let columns: Vec<&str> = spec.columns.iter().map(|(name, _)| *name).collect();
                    let values: Vec<String> = (0..rows.len())
                        .map(|row| {
                            let places: Vec<String> = (1..=width)
                                .map(|column| format!("${}", row * width + column))
                                .collect();
                            format!("({})", places.join(", "))
                        })
                        .collect();
                    let sql = format!(
                        "INSERT INTO {} ({}) VALUES {}",
                        spec.name,
                        columns.join(", "),
                        values.join(", ")
                    );
                    let params: Vec<&(dyn ToSql + Sync)> = rows
                        .iter()
                        .flat_map(|row| row.iter().map(|cell| cell as &(dyn ToSql + Sync)))
                        .collect();
                    tx.execute(&sql, &params).await.map_err(StoreError::from)?;
                }
                Batch::Done(spec, source_rows) => {
                    let target_rows: i64 =
                        query_one(&tx, &format!("SELECT COUNT(*) FROM {}", spec.name), &[])
                            .await
                            .map_err(StoreError::from)?
                            .get(0);
                    if target_rows as u64 != source_rows {
                        return Err(CopyError::CountMismatch {
                            table: spec.name,
                            source_rows,
                            target_rows: target_rows as u64,
                        });
                    }
                    if let Some(column) = spec.serial {
                        // New rows draw numbers past the copied ones.
                        tx.execute(
                            &format!(
                                "SELECT setval(pg_get_serial_sequence('{table}', '{column}'),
                                    COALESCE((SELECT MAX({column}) FROM {table}), 0) + 1, false)",
                                table = spec.name
                            ),
                            &[],
                        )
                        .await
                        .map_err(StoreError::from)?;
                    }
                    progress(spec.name, source_rows);
                    report.tables.push((spec.name, source_rows));
                }
            }
        }
        if report.tables.len() != TABLES.len() {
            return Err(StoreError::Backend(format!(
                "the source stopped after {} of {} tables; nothing was kept",
                report.tables.len(),
                TABLES.len()
            ))
            .into());
        }
        // Workers already running on the target look at once.
        self.notify(&tx).await.map_err(|err| err.into_error())?;
        tx.commit().await.map_err(StoreError::from)?;
        Ok(report)
    }
}
