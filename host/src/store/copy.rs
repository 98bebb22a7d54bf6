//! Moving a deployment between backends: `dexa store copy sqlite:PATH
//! postgres://...`.
//!
//! The copy is table by table, the same tables and columns on both sides
//! ([`TABLES`]), so every session keeps its state, messages, events, history,
//! timers and leases exactly. The source is read in one snapshot, in batches
//! of at most [`BATCH_ROWS`] rows and about [`BATCH_BYTES`] (memory stays
//! bounded by a few batches whatever the store's size), and
//! the target is written in one transaction: a copy that fails leaves the
//! target as it was. At the end the target's row counts must equal the
//! source's, or nothing is kept.

use std::path::Path;

use tokio::sync::mpsc;

use crate::flow::StoreError;
use crate::store::postgres::{PostgresStore, PostgresUrl};
use crate::store::sqlite::{SqliteOptions, SqliteStore};

/// How a column is stored (SQLite keeps booleans as integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Int,
    Text,
    Bytes,
    Bool,
}

/// One table both backends have.
#[derive(Debug)]
pub struct TableSpec {
    pub name: &'static str,
    pub columns: &'static [(&'static str, Kind)],
    /// The column a `BIGSERIAL` draws from on PostgreSQL, if any: its
    /// sequence is moved past the copied rows.
    pub serial: Option<&'static str>,
}

use Kind::{Bool, Bytes, Int, Text};

/// Every table, in an order where nothing refers to a later one.
pub const TABLES: &[TableSpec] = &[
    TableSpec {
        name: "flows",
        columns: &[
            ("flow_id", Text),
            ("flow_type", Text),
            ("status", Text),
            ("created_at_ms", Int),
            ("updated_at_ms", Int),
            ("error", Text),
        ],
        serial: None,
    },
    TableSpec {
        name: "tasks",
        columns: &[
            ("task_id", Int),
            ("flow_id", Text),
            ("flow_type", Text),
            ("step_type", Text),
            ("input", Text),
            ("state", Text),
            ("attempt", Int),
            ("not_before_ms", Int),
            ("wait_channel", Text),
            ("wait_key", Text),
            ("wait_count", Int),
            ("wake_at_ms", Int),
            ("policy", Text),
            ("failure_route", Text),
            ("failure", Text),
            ("locks", Text),
            ("lease_owner", Text),
            ("lease_token", Int),
            ("lease_expires_ms", Int),
            ("output_recorded", Bool),
            ("timer_fired", Bool),
            ("first_attempt_at_ms", Int),
            ("attempt_started_at_ms", Int),
        ],
        serial: Some("task_id"),
    },
    TableSpec {
        name: "attributes",
        columns: &[
            ("flow_id", Text),
            ("name", Text),
            ("key", Text),
            ("value", Text),
            ("version", Int),
        ],
        serial: None,
    },
    TableSpec {
        name: "channel_messages",
        columns: &[
            ("message_id", Int),
            ("flow_id", Text),
            ("channel", Text),
            ("key", Text),
            ("payload", Text),
            ("published_at_ms", Int),
        ],
        serial: Some("message_id"),
    },
    TableSpec {
        name: "streams",
        columns: &[
            ("flow_id", Text),
            ("stream", Text),
            ("next_seq", Int),
            ("total_bytes", Int),
            ("capacity_bytes", Int),
        ],
        serial: None,
    },
    TableSpec {
        name: "stream_entries",
        columns: &[
            ("flow_id", Text),
            ("stream", Text),
            ("seq", Int),
            ("payload", Text),
            ("bytes", Int),
            ("at_ms", Int),
        ],
        serial: None,
    },
    TableSpec {
        name: "step_history",
        columns: &[
            ("entry_id", Int),
            ("flow_id", Text),
            ("event_type", Text),
            ("step_type", Text),
            ("step_execution_id", Text),
            ("attempt", Int),
            ("at_ms", Int),
            ("detail", Text),
            ("started_at_ms", Int),
            ("component", Text),
        ],
        serial: Some("entry_id"),
    },
    TableSpec {
        name: "state_locks",
        columns: &[("flow_id", Text), ("name", Text), ("task_id", Int)],
        serial: None,
    },
    TableSpec {
        name: "components",
        columns: &[("digest", Text), ("record", Text), ("bytes", Bytes)],
        serial: None,
    },
    TableSpec {
        name: "activations",
        columns: &[
            ("seq", Int),
            ("agent", Text),
            ("role", Text),
            ("digest", Text),
            ("mode", Text),
            ("percent", Int),
            ("upgrade_in_flight", Bool),
            ("actor", Text),
            ("reason", Text),
            ("at_ms", Int),
        ],
        serial: Some("seq"),
    },
    TableSpec {
        name: "config_versions",
        columns: &[
            ("agent", Text),
            ("role", Text),
            ("digest", Text),
            ("at_ms", Int),
        ],
        serial: None,
    },
];

/// One stored value.
#[derive(Clone, Debug, PartialEq)]
pub enum Cell {
    Null,
    Int(i64),
    Text(String),
    Bytes(Vec<u8>),
    Bool(bool),
}

/// What the source sends the target: a batch of a table's rows, or the
/// table's row count once it is read.
#[derive(Debug)]
pub enum Batch {
    Rows(&'static TableSpec, Vec<Vec<Cell>>),
    Done(&'static TableSpec, u64),
}

/// Rows per batch at most; a batch is one multi-row insert on the target.
pub const BATCH_ROWS: usize = 500;

/// Bytes per batch at most (roughly: the text and blobs it carries), so
/// that a few big rows make a batch of their own; a single row larger than
/// this is a batch alone.
pub const BATCH_BYTES: usize = 8 << 20;

/// What a copy moved: rows per table, equal on both sides.
#[derive(Debug, Default)]
pub struct CopyReport {
    pub tables: Vec<(&'static str, u64)>,
}

/// Why a copy did not happen.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error(
        "the target store is not empty ({0}); copying into it would mix two deployments. \
         Pass --replace to empty it first"
    )]
    TargetNotEmpty(String),
    #[error("table {table}: the source has {source_rows} rows, the target {target_rows}; nothing was kept")]
    CountMismatch {
        table: &'static str,
        source_rows: u64,
        target_rows: u64,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Copies the SQLite store at `source` into the PostgreSQL store at
/// `target`. `replace` empties a non-empty target first (in the same
/// transaction); without it a non-empty target is refused. `progress` hears
/// of each table as it is done.
pub async fn sqlite_to_postgres(
    source: &Path,
    target: PostgresUrl,
    replace: bool,
    progress: &(dyn Fn(&str, u64) + Sync),
) -> Result<CopyReport, CopyError> {
    if !source.is_file() {
        return Err(StoreError::Backend(format!("{} does not exist", source.display())).into());
    }
    // Opening brings an older SQLite store up to this dexa's schema.
    let sqlite = SqliteStore::open(source, SqliteOptions::default())?;
    let postgres = PostgresStore::connect(target).await?;
    let (sender, batches) = mpsc::channel(2);
    let reader = tokio::task::spawn_blocking(move || sqlite.dump(sender));
    let loaded = postgres.load(batches, replace, progress).await;
    let read = reader
        .await
        .map_err(|err| StoreError::Backend(format!("the SQLite reader stopped: {err}")))?;
    // The reader's own error explains a load that ended early.
    read?;
    loaded
}
