//! The PostgreSQL schema and its version.
//!
//! The version lives in `dexa_schema`. Opening a store creates the schema in
//! an empty database and refuses one written by a newer dexa, naming both
//! versions; `dexa store migrate` applies the migrations of an older one.
//! Schema changes take a transaction-scoped advisory lock, so that two
//! processes starting at once do not both apply them.

use deadpool_postgres::Client;

use crate::flow::StoreError;

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = 1;

/// An arbitrary key for `pg_advisory_xact_lock`: "dexa" in ASCII.
const MIGRATION_LOCK: i64 = 0x6465_7861;

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS flows (
    flow_id        TEXT COLLATE "C" PRIMARY KEY,
    flow_type      TEXT NOT NULL,
    status         TEXT NOT NULL,
    created_at_ms  BIGINT NOT NULL,
    updated_at_ms  BIGINT NOT NULL,
    error          TEXT
);
CREATE INDEX IF NOT EXISTS flows_by_type ON flows (flow_type, created_at_ms);
-- The session listing's order: a page after a cursor walks the index.
CREATE INDEX IF NOT EXISTS flows_by_created ON flows (created_at_ms DESC, flow_id);

CREATE TABLE IF NOT EXISTS tasks (
    task_id               BIGSERIAL PRIMARY KEY,
    flow_id               TEXT NOT NULL,
    flow_type             TEXT NOT NULL,
    step_type             TEXT NOT NULL,
    input                 TEXT NOT NULL,
    state                 TEXT NOT NULL,
    attempt               BIGINT NOT NULL,
    not_before_ms         BIGINT NOT NULL,
    wait_channel          TEXT,
    wait_key              TEXT,
    wait_count            BIGINT,
    wake_at_ms            BIGINT,
    policy                TEXT NOT NULL,
    failure_route         TEXT,
    failure               TEXT,
    locks                 TEXT NOT NULL,
    lease_owner           TEXT,
    lease_token           BIGINT NOT NULL DEFAULT 0,
    lease_expires_ms      BIGINT,
    output_recorded       BOOLEAN NOT NULL DEFAULT FALSE,
    timer_fired           BOOLEAN NOT NULL DEFAULT FALSE,
    first_attempt_at_ms   BIGINT,
    attempt_started_at_ms BIGINT
);
-- Every claim, commit and lease change rewrites a task's indexed columns,
-- so each index is paid on every Step: the due indexes are partial (a row
-- is in the one its state needs), and one index serves a flow's lookups.
CREATE INDEX IF NOT EXISTS tasks_ready ON tasks (not_before_ms) WHERE state = 'ready';
CREATE INDEX IF NOT EXISTS tasks_waking ON tasks (wake_at_ms)
    WHERE state = 'waiting' AND wake_at_ms IS NOT NULL;
CREATE INDEX IF NOT EXISTS tasks_leased ON tasks (lease_expires_ms) WHERE state = 'leased';
CREATE INDEX IF NOT EXISTS tasks_by_flow_state ON tasks (flow_id, state);

CREATE TABLE IF NOT EXISTS attributes (
    flow_id  TEXT NOT NULL,
    name     TEXT NOT NULL,
    key      TEXT COLLATE "C" NOT NULL,   -- bytewise, as in SQLite
    value    TEXT NOT NULL,
    version  BIGINT NOT NULL,
    PRIMARY KEY (flow_id, name, key)
);

CREATE TABLE IF NOT EXISTS channel_messages (
    message_id       BIGSERIAL PRIMARY KEY,
    flow_id          TEXT NOT NULL,
    channel          TEXT NOT NULL,
    key              TEXT NOT NULL,
    payload          TEXT NOT NULL,
    published_at_ms  BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS channel_lookup ON channel_messages (flow_id, channel, key, message_id);

CREATE TABLE IF NOT EXISTS streams (
    flow_id         TEXT NOT NULL,
    stream          TEXT NOT NULL,
    next_seq        BIGINT NOT NULL,
    total_bytes     BIGINT NOT NULL,
    capacity_bytes  BIGINT NOT NULL,
    PRIMARY KEY (flow_id, stream)
);

CREATE TABLE IF NOT EXISTS stream_entries (
    flow_id  TEXT NOT NULL,
    stream   TEXT NOT NULL,
    seq      BIGINT NOT NULL,
    payload  TEXT NOT NULL,
    bytes    BIGINT NOT NULL,
    at_ms    BIGINT NOT NULL,
    PRIMARY KEY (flow_id, stream, seq)
);

CREATE TABLE IF NOT EXISTS step_history (
    entry_id           BIGSERIAL PRIMARY KEY,
    flow_id            TEXT NOT NULL,
    event_type         TEXT NOT NULL,
    step_type          TEXT NOT NULL,
    step_execution_id  TEXT NOT NULL,
    attempt            BIGINT NOT NULL,
    at_ms              BIGINT NOT NULL,
    detail             TEXT,
    started_at_ms      BIGINT,
    component          TEXT
);
CREATE INDEX IF NOT EXISTS step_history_by_flow ON step_history (flow_id, entry_id);

CREATE TABLE IF NOT EXISTS state_locks (
    flow_id  TEXT NOT NULL,
    name     TEXT NOT NULL,
    task_id  BIGINT NOT NULL,
    PRIMARY KEY (flow_id, name, task_id)
);
CREATE INDEX IF NOT EXISTS state_locks_by_task ON state_locks (task_id);

CREATE TABLE IF NOT EXISTS components (
    digest  TEXT PRIMARY KEY,
    record  TEXT NOT NULL,
    bytes   BYTEA NOT NULL
);

CREATE TABLE IF NOT EXISTS activations (
    seq                BIGSERIAL PRIMARY KEY,
    agent              TEXT NOT NULL,
    role               TEXT NOT NULL,
    digest             TEXT NOT NULL,
    mode               TEXT NOT NULL,
    percent            BIGINT,
    upgrade_in_flight  BOOLEAN NOT NULL,
    actor              TEXT NOT NULL,
    reason             TEXT NOT NULL,
    at_ms              BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS activations_by_role ON activations (agent, role, seq);

CREATE TABLE IF NOT EXISTS config_versions (
    agent   TEXT NOT NULL,
    role    TEXT NOT NULL,
    digest  TEXT NOT NULL,
    at_ms   BIGINT NOT NULL,
    PRIMARY KEY (agent, role, digest)
);
"#;

/// What opening found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchemaState {
    /// The schema is this build's.
    Current,
    /// An older schema; `dexa store migrate` brings it up to date.
    Older(i64),
}

/// The version a database holds, 0 when it has no dexa schema.
pub async fn version(client: &Client) -> Result<i64, StoreError> {
    let exists = client
        .query_one("SELECT to_regclass('dexa_schema') IS NOT NULL", &[])
        .await?;
    if !exists.get::<_, bool>(0) {
        return Ok(0);
    }
    let row = client
        .query_opt("SELECT version FROM dexa_schema", &[])
        .await?;
    Ok(row.map(|row| row.get::<_, i64>(0)).unwrap_or(0))
}

/// Refuses a schema newer than this build knows.
fn refuse_newer(found: i64) -> Result<(), StoreError> {
    if found > SCHEMA_VERSION {
        return Err(StoreError::Backend(format!(
            "the PostgreSQL store was written by a newer dexa (schema {found}, this one knows \
             {SCHEMA_VERSION}); upgrade dexa, or point it at another database"
        )));
    }
    Ok(())
}

/// Creates the schema in an empty database; checks the version otherwise.
pub async fn open(client: &mut Client) -> Result<SchemaState, StoreError> {
    let found = version(client).await?;
    refuse_newer(found)?;
    match found {
        0 => {
            migrate(client).await?;
            Ok(SchemaState::Current)
        }
        SCHEMA_VERSION => Ok(SchemaState::Current),
        older => Ok(SchemaState::Older(older)),
    }
}

/// Applies every migration up to [`SCHEMA_VERSION`]; returns the versions
/// before and after.
pub async fn migrate(client: &mut Client) -> Result<(i64, i64), StoreError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS dexa_schema (version BIGINT NOT NULL)")
        .await?;
    let found: i64 = tx
        .query_opt("SELECT version FROM dexa_schema", &[])
        .await?
        .map(|row| row.get(0))
        .unwrap_or(0);
    refuse_newer(found)?;
    if found < SCHEMA_VERSION {
        // Schema 1 is the first: later migrations go here, each guarded by
        // the version it upgrades from.
        tx.batch_execute(SCHEMA).await?;
        tx.execute("DELETE FROM dexa_schema", &[]).await?;
        tx.execute(
            "INSERT INTO dexa_schema (version) VALUES ($1)",
            &[&SCHEMA_VERSION],
        )
        .await?;
    }
    tx.commit().await?;
    Ok((found, SCHEMA_VERSION))
}

/// Creates a schema of the store's own (`schema=` in its address).
pub async fn create_own(client: &Client, schema: &str) -> Result<(), StoreError> {
    client
        .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
        .await?;
    Ok(())
}

/// Drops a schema of the store's own with everything in it.
pub async fn drop_own(client: &Client, schema: &str) -> Result<(), StoreError> {
    client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await?;
    Ok(())
}
