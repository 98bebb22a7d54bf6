//! Store backends for the Flow engine. Each implements
//! [`crate::flow::FlowStore`] and passes the same conformance suite
//! (`tests/tests/flow_conformance.rs`).

pub(crate) mod rows;
pub mod sqlite;
