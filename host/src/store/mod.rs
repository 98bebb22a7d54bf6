//! Store backends for the Flow engine. Each implements
//! [`crate::flow::FlowStore`] and passes the same conformance suite
//! (`tests/tests/flow_conformance.rs`).

pub mod sqlite;

use std::sync::Arc;

use crate::flow::FlowStore;

/// Opens the store a URL names: `sqlite://PATH` (or a plain path), with an
/// optional `?synchronous=full|normal`.
pub fn open(url: &str) -> anyhow::Result<Arc<dyn FlowStore>> {
    let rest = url.strip_prefix("sqlite://").unwrap_or(url);
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let mut options = sqlite::SqliteOptions::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("synchronous", value)) => {
                options.synchronous = value.parse().map_err(anyhow::Error::msg)?;
            }
            _ => anyhow::bail!(
                "store URL {url:?}: unknown option {pair:?} (known: synchronous=full|normal)"
            ),
        }
    }
    Ok(Arc::new(sqlite::SqliteStore::open(path, options)?))
}
