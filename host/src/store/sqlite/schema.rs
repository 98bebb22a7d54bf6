//! The SQLite schema, created on open.

use rusqlite::Connection;

use crate::flow::StoreError;

const SCHEMA_VERSION: i64 = 3;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS flows (
    flow_id        TEXT PRIMARY KEY,
    flow_type      TEXT NOT NULL,
    status         TEXT NOT NULL,
    created_at_ms  INTEGER NOT NULL,
    updated_at_ms  INTEGER NOT NULL,
    error          TEXT
);
CREATE INDEX IF NOT EXISTS flows_by_type ON flows (flow_type, created_at_ms);
-- The session listing's order: a page after a cursor walks the index.
CREATE INDEX IF NOT EXISTS flows_by_created ON flows (created_at_ms DESC, flow_id);

-- One row per Step execution; retries update it in place.
CREATE TABLE IF NOT EXISTS tasks (
    task_id              INTEGER PRIMARY KEY AUTOINCREMENT,
    flow_id              TEXT NOT NULL,
    flow_type            TEXT NOT NULL,
    step_type            TEXT NOT NULL,
    input                TEXT NOT NULL,
    state                TEXT NOT NULL,          -- waiting | ready | leased
    attempt              INTEGER NOT NULL,
    not_before_ms        INTEGER NOT NULL,
    wait_channel         TEXT,
    wait_key             TEXT,
    wait_count           INTEGER,
    wake_at_ms           INTEGER,
    policy               TEXT NOT NULL,
    failure_route        TEXT,
    failure              TEXT,
    locks                TEXT NOT NULL,
    lease_owner          TEXT,
    lease_token          INTEGER NOT NULL DEFAULT 0,
    lease_expires_ms     INTEGER,
    output_recorded      INTEGER NOT NULL DEFAULT 0,
    timer_fired          INTEGER NOT NULL DEFAULT 0,
    first_attempt_at_ms  INTEGER,
    attempt_started_at_ms INTEGER
);
-- Partial indexes, one per state: a task's state change moves it between
-- two of them and leaves the others alone, where an index on (state, ...)
-- for each would change all of them. Additive (no version bump; see
-- `migrate`): an older dexa works on the same store.
CREATE INDEX IF NOT EXISTS tasks_ready_at ON tasks (not_before_ms) WHERE state = 'ready';
CREATE INDEX IF NOT EXISTS tasks_waiting_until ON tasks (wake_at_ms) WHERE state = 'waiting';
CREATE INDEX IF NOT EXISTS tasks_leased_until ON tasks (lease_expires_ms) WHERE state = 'leased';
-- Which waiting tasks a message to a channel wakes.
CREATE INDEX IF NOT EXISTS tasks_waiting_on ON tasks (flow_id, wait_channel, wait_key)
    WHERE state = 'waiting';
-- A flow's tasks; fair claims count each candidate flow's leased tasks.
CREATE INDEX IF NOT EXISTS tasks_by_flow_state ON tasks (flow_id, state);

-- Attributes use key ''; AttributeMaps one row per key.
CREATE TABLE IF NOT EXISTS attributes (
    flow_id  TEXT NOT NULL,
    name     TEXT NOT NULL,
    key      TEXT NOT NULL,
    value    TEXT NOT NULL,
    version  INTEGER NOT NULL,
    PRIMARY KEY (flow_id, name, key)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS channel_messages (
    message_id       INTEGER PRIMARY KEY AUTOINCREMENT,
    flow_id          TEXT NOT NULL,
    channel          TEXT NOT NULL,
    key              TEXT NOT NULL,
    payload          TEXT NOT NULL,
    published_at_ms  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS channel_lookup ON channel_messages (flow_id, channel, key, message_id);

-- How often each flow's tasks were taken (a cancel, a stop): the stream
-- watch wakes the flow's running Steps in every process when it moves.
-- Additive (no version bump): an older dexa never reads or writes it.
CREATE TABLE IF NOT EXISTS flow_revocations (
    flow_id  TEXT PRIMARY KEY,
    seq      INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS streams (
    flow_id         TEXT NOT NULL,
    stream          TEXT NOT NULL,
    next_seq        INTEGER NOT NULL,
    total_bytes     INTEGER NOT NULL,
    capacity_bytes  INTEGER NOT NULL,
    PRIMARY KEY (flow_id, stream)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS stream_entries (
    flow_id  TEXT NOT NULL,
    stream   TEXT NOT NULL,
    seq      INTEGER NOT NULL,
    payload  TEXT NOT NULL,
    bytes    INTEGER NOT NULL,
    at_ms    INTEGER NOT NULL,
    PRIMARY KEY (flow_id, stream, seq)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS step_history (
    entry_id           INTEGER PRIMARY KEY AUTOINCREMENT,
    flow_id            TEXT NOT NULL,
    event_type         TEXT NOT NULL,
    step_type          TEXT NOT NULL,
    step_execution_id  TEXT NOT NULL,
    attempt            INTEGER NOT NULL,
    at_ms              INTEGER NOT NULL,
    detail             TEXT,
    started_at_ms      INTEGER,
    component          TEXT       -- the digest of the component that ran
);
CREATE INDEX IF NOT EXISTS step_history_by_flow ON step_history (flow_id, entry_id);

-- Attribute names a running Step holds; RPCs that lock them conflict.
CREATE TABLE IF NOT EXISTS state_locks (
    flow_id  TEXT NOT NULL,
    name     TEXT NOT NULL,
    task_id  INTEGER NOT NULL,
    PRIMARY KEY (flow_id, name, task_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS state_locks_by_task ON state_locks (task_id);

-- The component catalog: versions by digest, with their bytes.
CREATE TABLE IF NOT EXISTS components (
    digest  TEXT PRIMARY KEY,
    record  TEXT NOT NULL,
    bytes   BLOB NOT NULL
);

-- Append-only: which version each agent's role takes.
CREATE TABLE IF NOT EXISTS activations (
    seq                INTEGER PRIMARY KEY AUTOINCREMENT,
    agent              TEXT NOT NULL,
    role               TEXT NOT NULL,
    digest             TEXT NOT NULL,
    mode               TEXT NOT NULL,   -- current | ramp
    percent            INTEGER,
    upgrade_in_flight  INTEGER NOT NULL,
    actor              TEXT NOT NULL,
    reason             TEXT NOT NULL,
    at_ms              INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS activations_by_role ON activations (agent, role, seq);

-- Every version of each role's file that dexa.toml has named at a start.
CREATE TABLE IF NOT EXISTS config_versions (
    agent   TEXT NOT NULL,
    role    TEXT NOT NULL,
    digest  TEXT NOT NULL,
    at_ms   INTEGER NOT NULL,
    PRIMARY KEY (agent, role, digest)
) WITHOUT ROWID;
";

pub(super) fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    // The version is read inside the write lock, so two processes opening an
    // old store at once do not both upgrade it.
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let version: i64 = tx.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::Backend(format!(
            "the store was written by a newer dexa (schema {version}, this one knows {SCHEMA_VERSION})"
        )));
    }
    // The tasks' old per-state indexes give way to the partial ones, in the
    // transaction that makes those. This is no schema change: an older dexa
    // on the same store (a rolling upgrade) reads and writes it as before,
    // and makes its own indexes again when it opens it; they go again at
    // this one's next open.
    tx.execute_batch(
        "DROP INDEX IF EXISTS tasks_ready;
         DROP INDEX IF EXISTS tasks_waking;
         DROP INDEX IF EXISTS tasks_leased;
         DROP INDEX IF EXISTS tasks_by_flow;",
    )?;
    tx.execute_batch(SCHEMA)?;
    // Schema 2: when each history entry's attempt started.
    if version == 1 {
        tx.execute_batch("ALTER TABLE step_history ADD COLUMN started_at_ms INTEGER")?;
    }
    // Schema 3: which component version ran each Step (the catalog's
    // tables are new and created above).
    if (1..=2).contains(&version) {
        tx.execute_batch("ALTER TABLE step_history ADD COLUMN component TEXT")?;
    }
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    Ok(tx.commit()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store written by schema 1 gains the history's start times; its old
    /// rows read as unknown.
    #[test]
    fn a_schema_1_store_is_migrated_in_place() {
        let mut conn = Connection::open_in_memory().unwrap_or_else(|err| panic!("{err}"));
        conn.execute_batch(
            "CREATE TABLE step_history (
                entry_id INTEGER PRIMARY KEY AUTOINCREMENT, flow_id TEXT NOT NULL,
                event_type TEXT NOT NULL, step_type TEXT NOT NULL,
                step_execution_id TEXT NOT NULL, attempt INTEGER NOT NULL,
                at_ms INTEGER NOT NULL, detail TEXT);
             INSERT INTO step_history (flow_id, event_type, step_type, step_execution_id, attempt, at_ms)
                 VALUES ('f', 'execute_completed', 'A', 'x', 1, 5);
             PRAGMA user_version = 1;",
        )
        .unwrap_or_else(|err| panic!("{err}"));
        migrate(&mut conn).unwrap_or_else(|err| panic!("{err}"));
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(version, SCHEMA_VERSION);
        let (started, component): (Option<i64>, Option<String>) = conn
            .query_row(
                "SELECT started_at_ms, component FROM step_history",
                [],
                |row| Ok((row.get(0)?, row.get(1)?)),
            )
            .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!((started, component), (None, None));
        // Migrating again changes nothing.
        migrate(&mut conn).unwrap_or_else(|err| panic!("{err}"));
        conn.execute_batch("PRAGMA user_version = 99;")
            .unwrap_or_else(|err| panic!("{err}"));
        let newer = migrate(&mut conn)
            .map(|_| ())
            .map_err(|err| err.to_string());
        assert!(
            newer.as_ref().is_err_and(|e| e.contains("newer dexa")),
            "{newer:?}"
        );
    }

    /// The names of the `tasks` table's indexes, sorted.
    fn task_indexes(conn: &Connection) -> Vec<String> {
        let mut stmt = conn
            .prepare(
                "SELECT name FROM sqlite_master
                 WHERE type = 'index' AND tbl_name = 'tasks' AND sql IS NOT NULL ORDER BY name",
            )
            .unwrap_or_else(|err| panic!("{err}"));
        let names = stmt
            .query_map([], |row| row.get::<_, String>(0))
            .unwrap_or_else(|err| panic!("{err}"))
            .collect::<Result<Vec<_>, _>>()
            .unwrap_or_else(|err| panic!("{err}"));
        names
    }

    /// A store with the four old state indexes on `tasks` (made by an
    /// older dexa) trades them for partial ones, keeping its tasks; a new
    /// store has the same indexes.
    #[test]
    fn a_store_with_the_old_task_indexes_gets_the_partial_ones() {
        let mut old = Connection::open_in_memory().unwrap_or_else(|err| panic!("{err}"));
        migrate(&mut old).unwrap_or_else(|err| panic!("{err}"));
        old.execute_batch(
            "DROP INDEX tasks_ready_at; DROP INDEX tasks_waiting_until;
             DROP INDEX tasks_leased_until; DROP INDEX tasks_waiting_on;
             CREATE INDEX tasks_ready ON tasks (state, not_before_ms);
             CREATE INDEX tasks_waking ON tasks (state, wake_at_ms);
             CREATE INDEX tasks_leased ON tasks (state, lease_expires_ms);
             CREATE INDEX tasks_by_flow ON tasks (flow_id, wait_channel, wait_key);
             INSERT INTO tasks (flow_id, flow_type, step_type, input, state, attempt,
                 not_before_ms, policy, locks)
                 VALUES ('f', 'T', 'S', '{}', 'ready', 1, 0, '{}', '[]');
             PRAGMA user_version = 3;",
        )
        .unwrap_or_else(|err| panic!("{err}"));
        migrate(&mut old).unwrap_or_else(|err| panic!("{err}"));

        let mut new = Connection::open_in_memory().unwrap_or_else(|err| panic!("{err}"));
        migrate(&mut new).unwrap_or_else(|err| panic!("{err}"));
        let expected = [
            "tasks_by_flow_state",
            "tasks_leased_until",
            "tasks_ready_at",
            "tasks_waiting_on",
            "tasks_waiting_until",
        ];
        for conn in [&old, &new] {
            assert_eq!(task_indexes(conn), expected);
            // Only the flow index keeps every task; the others are partial.
            for name in &expected[1..] {
                let sql: String = conn
                    .query_row(
                        "SELECT sql FROM sqlite_master WHERE name = ?1",
                        [name],
                        |row| row.get(0),
                    )
                    .unwrap_or_else(|err| panic!("{err}"));
                assert!(
                    sql.contains("WHERE state = '"),
                    "{name} is not partial: {sql}"
                );
            }
        }
        let tasks: i64 = old
            .query_row(
                "SELECT COUNT(*) FROM tasks WHERE state = 'ready'",
                [],
                |row| row.get(0),
            )
            .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(tasks, 1);
    }
}
