//! Store backends for the Flow engine. Each implements
//! [`crate::flow::FlowStore`] and passes the same conformance suite
//! (`tests/tests/flow_conformance.rs`).

pub mod copy;
pub mod postgres;
pub(crate) mod rows;
pub mod sqlite;
pub mod stream_signals;
pub(crate) mod write_plan;

use std::sync::Arc;

use crate::catalog::CatalogStore;
use crate::flow::{FlowStore, StoreError};

/// Opens the store at `address`: a `postgres://` address, or else a SQLite
/// path (`sqlite:PATH` or a bare path) with the default options. For tools
/// and tests that take a store on the command line; `dexa.toml` has its own
/// parser with every option.
pub async fn open_address(
    address: &str,
) -> Result<(Arc<dyn FlowStore>, Arc<dyn CatalogStore>), StoreError> {
    if address.starts_with("postgres://") || address.starts_with("postgresql://") {
        let url = postgres::PostgresUrl::parse(address).map_err(StoreError::Backend)?;
        let store = Arc::new(postgres::PostgresStore::connect(url).await?);
        return Ok((store.clone(), store));
    }
    let path = address
        .strip_prefix("sqlite://")
        .or_else(|| address.strip_prefix("sqlite:"))
        .unwrap_or(address);
    let store = Arc::new(sqlite::SqliteStore::open(path, Default::default())?);
    Ok((store.clone(), store))
}
