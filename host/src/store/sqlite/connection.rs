//! Opening a store: connections, their settings, and the wait for other
//! processes that create or migrate the same file at the same moment.

use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use rusqlite::config::DbConfig;
use rusqlite::Connection;

use super::schema;
use crate::flow::store::StoreError;

/// How hard SQLite syncs a commit to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// Durable across process crashes; see the module docs.
    #[default]
    Normal,
    /// Also durable across OS crashes and power loss; one fsync per commit.
    Full,
}

impl FromStr for Synchronous {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.to_ascii_lowercase().as_str() {
            "normal" => Ok(Synchronous::Normal),
            "full" => Ok(Synchronous::Full),
            other => Err(format!("synchronous must be normal or full, not {other:?}")),
        }
    }
}

/// How a SQLite store is opened: `store = "sqlite:PATH?synchronous=full"`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SqliteOptions {
    pub synchronous: Synchronous,
}

pub(super) const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// A further connection to a store whose writer is open (its file is in WAL
/// mode already, so this takes no lock that can be refused for long).
pub(super) fn open_reader(path: &Path, options: &SqliteOptions) -> Result<Connection, StoreError> {
    let started = Instant::now();
    loop {
        match connect(path, options) {
            Err(err) if is_lock_wait(&err) && started.elapsed() < OPEN_PATIENCE => {
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

pub(super) fn connect(path: &Path, options: &SqliteOptions) -> Result<Connection, StoreError> {
    let conn = Connection::open(path)
        .map_err(|err| StoreError::Backend(format!("cannot open {}: {err}", path.display())))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    let sync = match options.synchronous {
        Synchronous::Normal => "NORMAL",
        Synchronous::Full => "FULL",
    };
    conn.pragma_update(None, "synchronous", sync)?;
    // Without the planner's stability guarantee, SQLite (3.54) marks a
    // statement with a bound `LIMIT ?` (or `LIKE ?`, or some `col = ?`) to be
    // planned again for the value, and recompiles it on the first step
    // after any bind: on every run, since rusqlite clears a statement's
    // bindings when it returns it to the cache. The claims, the stream and
    // map reads and the history pages all have one, and recompiling them
    // was a twentieth of the CPU of a benchmark turn. Plans that ignore the
    // bound values are the ones these indexed lookups want anyway (no
    // statistics are gathered). The `tasks` table's per-state indexes are
    // partial: a statement uses one only when it names the state as a
    // literal (`state = 'ready'`), never as a bound value, which the plan
    // would ignore and scan the table.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    conn.set_prepared_statement_cache_capacity(256);
    Ok(conn)
}

/// How long opening a store waits for other processes that are creating or
/// migrating the same file at the same moment.
const OPEN_PATIENCE: Duration = Duration::from_secs(30);

/// SQLite's own words for a lock another connection holds.
fn is_lock_wait(err: &StoreError) -> bool {
    matches!(err, StoreError::Backend(message)
        if message.contains("database is locked") || message.contains("database is busy"))
}

/// The writer connection, with the schema created or migrated. Switching a
/// new file to WAL and migrating take locks that SQLite may refuse at once
/// (without its busy handler) while another process does the same, so
/// those refusals wait their turn instead of failing the open.
pub(super) fn open_writer(path: &Path, options: &SqliteOptions) -> Result<Connection, StoreError> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        let attempt = connect(path, options).and_then(|mut conn| {
            schema::migrate(&mut conn)?;
            Ok(conn)
        });
        match attempt {
            Err(err) if is_lock_wait(&err) && started.elapsed() < OPEN_PATIENCE => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::SqliteStore;
    use std::sync::Arc;

    /// A cached statement with `LIMIT ?` runs as compiled: binding a new
    /// limit does not make SQLite compile it again (it did on every run
    /// before the planner's stability guarantee was set).
    #[test]
    fn a_cached_statement_with_a_bound_limit_is_not_recompiled_on_each_run() {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("tempdir: {err}"));
        let path = dir.path().join("limits.sqlite");
        let conn = connect(&path, &SqliteOptions::default())
            .unwrap_or_else(|err| panic!("connect: {err}"));
        conn.execute_batch(
            "CREATE TABLE rows (flow TEXT, seq INTEGER, PRIMARY KEY (flow, seq));
             INSERT INTO rows VALUES ('a', 1), ('a', 2), ('a', 3), ('b', 1);",
        )
        .unwrap_or_else(|err| panic!("schema: {err}"));
        let guaranteed = conn
            .db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG)
            .unwrap_or_else(|err| panic!("db_config: {err}"));
        assert!(guaranteed, "the planner's stability guarantee is on");
        let sql = "SELECT seq FROM rows WHERE flow = ?1 AND seq > ?2 ORDER BY seq LIMIT ?3";
        for limit in 1..=20_i64 {
            let mut stmt = conn
                .prepare_cached(sql)
                .unwrap_or_else(|err| panic!("prepare: {err}"));
            let seqs = stmt
                .query_map(rusqlite::params!["a", 0, limit], |row| row.get::<_, i64>(0))
                .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
                .unwrap_or_else(|err| panic!("query: {err}"));
            assert_eq!(seqs.len() as i64, limit.min(3), "limit {limit}");
            let recompiled = stmt.get_status(rusqlite::StatementStatus::RePrepare);
            assert_eq!(
                recompiled, 0,
                "recompiled {recompiled} times by run {limit}"
            );
        }
    }

    /// A process creating or migrating the store holds its lock longer than
    /// SQLite's busy timeout (a slow disk, a long migration): another
    /// process opening the store meanwhile waits its turn instead of
    /// failing with "database is locked".
    #[test]
    fn an_open_waits_for_a_creator_that_holds_the_store_past_the_busy_timeout() {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("tempdir: {err}"));
        let path = dir.path().join("held.sqlite");
        let holder = Connection::open(&path).unwrap_or_else(|err| panic!("open: {err}"));
        holder
            .execute_batch("BEGIN EXCLUSIVE; CREATE TABLE creating (x INTEGER);")
            .unwrap_or_else(|err| panic!("hold: {err}"));
        let opener = std::thread::spawn({
            let path = path.clone();
            move || SqliteStore::open(&path, SqliteOptions::default()).map(|_| ())
        });
        std::thread::sleep(BUSY_TIMEOUT + Duration::from_secs(1));
        holder
            .execute_batch("COMMIT")
            .unwrap_or_else(|err| panic!("release: {err}"));
        let opened = opener.join().unwrap_or_else(|_| panic!("opener panicked"));
        assert!(opened.is_ok(), "{opened:?}");
    }

    /// Workers and clients that start together open one new store at the
    /// same moment; every open must succeed (SQLite refuses some of the
    /// lock takes of creating the file without waiting).
    #[test]
    fn many_openers_of_one_new_store_all_succeed() {
        for round in 0..5 {
            let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("tempdir: {err}"));
            let path = dir.path().join(format!("new-{round}.sqlite"));
            let start = Arc::new(std::sync::Barrier::new(12));
            let openers: Vec<_> = (0..12)
                .map(|_| {
                    let (path, start) = (path.clone(), start.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        SqliteStore::open(&path, SqliteOptions::default()).map(|_| ())
                    })
                })
                .collect();
            for opener in openers {
                let opened = opener.join().unwrap_or_else(|_| panic!("opener panicked"));
                assert!(opened.is_ok(), "round {round}: {opened:?}");
            }
        }
    }
}
