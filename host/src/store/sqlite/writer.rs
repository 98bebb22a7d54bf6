//! The writer thread: one connection that runs every write of this process,
//! in batches (group commit), and watches for other processes' commits.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rusqlite::Connection;
use tokio::sync::Notify;

use super::sql::{cached_execute, now_millis};
use crate::flow::store::StoreError;
use crate::flow::types::StoreMillis;

/// What a write job reports back to the writer thread.
pub(super) struct JobDone {
    /// False rolls the job's savepoint back.
    pub(super) ok: bool,
    /// The job may have made a task ready: wake the workers.
    pub(super) wake: bool,
    /// Hands the result to the caller once the batch's commit is known.
    pub(super) deliver: Box<dyn FnOnce(Result<(), String>) + Send>,
}

/// A write, run by the writer thread inside the batch's transaction, or
/// handed the reason no transaction could be opened.
pub(super) type WriteJob =
    Box<dyn FnOnce(Result<&Connection, String>, StoreMillis) -> JobDone + Send>;

/// Writes queued together share one transaction (group commit).
const MAX_BATCH: usize = 256;

const WATCH_INTERVAL: Duration = Duration::from_millis(10);

const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);

/// The writer thread: owns the write connection, runs queued writes in
/// batches (one transaction, a savepoint per write, one commit), and between
/// batches watches `data_version`, which changes only when another process
/// commits, to wake this process's workers.
pub(super) fn run_writer(
    conn: Connection,
    queue: mpsc::Receiver<WriteJob>,
    signal: Arc<Notify>,
    // Dropped with this thread, which stops the checkpointer.
    _checkpoints: mpsc::Sender<()>,
) {
    let data_version = |conn: &Connection| -> Option<i64> {
        conn.query_row("PRAGMA data_version", [], |row| row.get(0))
            .ok()
    };
    let mut last_version = data_version(&conn);
    let mut last_check = Instant::now();
    loop {
        match queue.recv_timeout(WATCH_INTERVAL) {
            Ok(first) => {
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match queue.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_) => break,
                    }
                }
                if run_batch(&conn, batch) {
                    signal.notify_waiters();
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if last_check.elapsed() >= WATCH_INTERVAL {
            last_check = Instant::now();
            let version = data_version(&conn);
            if version != last_version {
                last_version = version;
                signal.notify_waiters();
            }
        }
    }
}

/// Copies the WAL back into the database file every second, without
/// blocking writers; it stops when the writer thread does.
pub(super) fn spawn_checkpointer(conn: Connection) -> Result<mpsc::Sender<()>, StoreError> {
    let (alive, stopped) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("dexa-sqlite-checkpoint".to_string())
        .spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(CHECKPOINT_INTERVAL)
            {
                if let Err(err) = conn.execute_batch("PRAGMA wal_checkpoint(PASSIVE)") {
                    tracing::debug!(error = %err, "WAL checkpoint failed; will retry");
                }
            }
        })
        .map_err(|err| StoreError::Backend(format!("cannot start the checkpoint thread: {err}")))?;
    Ok(alive)
}

/// Runs one batch; true when a committed write may have made work ready.
fn run_batch(conn: &Connection, batch: Vec<WriteJob>) -> bool {
    metrics::histogram!(crate::telemetry::SQLITE_BATCH_WRITES).record(batch.len() as f64);
    let began_at = std::time::Instant::now();
    let began = cached_execute(conn, "BEGIN IMMEDIATE", []);
    // The clock is read once the write lock is held: BEGIN may wait up to
    // the busy timeout for another process, and a time read before it
    // would shorten every lease the batch grants and misjudge expiries.
    let now = now_millis();
    if let Err(err) = began {
        let reason = format!("cannot begin a write transaction: {err}");
        for job in batch {
            (job(Err(reason.clone()), now).deliver)(Err(reason.clone()));
        }
        return false;
    }
    let done = if batch.len() == 1 {
        run_alone(conn, batch, now)
    } else {
        run_in_savepoints(conn, batch, now)
    };
    let committed = if done.iter().any(|d| d.ok) {
        cached_execute(conn, "COMMIT", [])
            .map(|_| ())
            .map_err(|err| {
                rollback(conn);
                format!("commit failed: {err}")
            })
    } else {
        // No write succeeded: there is nothing to keep, and a failed write's
        // own error is its answer (the outcome it is handed is not read).
        rollback(conn);
        Ok(())
    };
    // From BEGIN (which may wait for another process's write lock) to the
    // end of COMMIT (the fsync): what each write of the batch waited for.
    metrics::histogram!(crate::telemetry::SQLITE_BATCH_COMMIT)
        .record(began_at.elapsed().as_secs_f64());
    let wake = committed.is_ok() && done.iter().any(|d| d.ok && d.wake);
    for result in done {
        (result.deliver)(committed.clone());
    }
    wake
}

/// A batch of one write runs without a savepoint: when it fails, the whole
/// transaction rolls back instead. A savepoint would first copy every page
/// the write changes into a sub-journal, in case it rolls back: a tenth of
/// the writer's time when each Step commits alone.
fn run_alone(conn: &Connection, batch: Vec<WriteJob>, now: StoreMillis) -> Vec<JobDone> {
    let mut done = Vec::with_capacity(1);
    for job in batch {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(Ok(conn), now))) {
            Ok(result) => done.push(result),
            // Its reply sender is gone with it; the batch rolls back.
            Err(_) => tracing::error!("a store write panicked; it was rolled back"),
        }
    }
    done
}

/// Runs each write of a batch in its own savepoint, so that one that fails
/// (or panics) is undone alone and the others still commit.
fn run_in_savepoints(conn: &Connection, batch: Vec<WriteJob>, now: StoreMillis) -> Vec<JobDone> {
    let mut done = Vec::with_capacity(batch.len());
    for job in batch {
        let savepoint = cached_execute(conn, "SAVEPOINT job", []);
        let outcome = match savepoint {
            Ok(_) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(Ok(conn), now))),
            Err(err) => Ok(job(Err(format!("cannot open a savepoint: {err}")), now)),
        };
        match outcome {
            Ok(result) => {
                let closed = if result.ok {
                    cached_execute(conn, "RELEASE job", [])
                } else {
                    cached_execute(conn, "ROLLBACK TO job", [])
                        .and_then(|_| cached_execute(conn, "RELEASE job", []))
                };
                if let Err(err) = closed {
                    tracing::error!(error = %err, "closing a savepoint failed");
                }
                done.push(result);
            }
            Err(_) => {
                // The job panicked (its reply sender is gone with it): undo it.
                tracing::error!("a store write panicked; it was rolled back");
                let _ = cached_execute(conn, "ROLLBACK TO job", [])
                    .and_then(|_| cached_execute(conn, "RELEASE job", []));
            }
        }
    }
    done
}

/// Ends the batch's transaction without keeping anything.
fn rollback(conn: &Connection) {
    if let Err(err) = conn.execute_batch("ROLLBACK") {
        tracing::error!(error = %err, "rolling back a write transaction failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write that inserts `value`, then succeeds or fails (after writing)
    /// or panics (after writing); what it is handed at the end goes to
    /// `outcomes`.
    fn insert(
        value: i64,
        end: &'static str,
        outcomes: &mpsc::Sender<(i64, Result<(), String>)>,
    ) -> WriteJob {
        let outcomes = outcomes.clone();
        Box::new(move |conn, _now| {
            let conn = conn.expect("a transaction");
            conn.execute("INSERT INTO t VALUES (?1)", [value])
                .expect("insert");
            if end == "panic" {
                panic!("a write that panics after writing");
            }
            JobDone {
                ok: end == "ok",
                wake: true,
                deliver: Box::new(move |committed| {
                    let _ = outcomes.send((value, committed));
                }),
            }
        })
    }

    fn table() -> Connection {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch("CREATE TABLE t (v INTEGER)")
            .expect("create");
        conn
    }

    fn values(conn: &Connection) -> Vec<i64> {
        let mut statement = conn.prepare("SELECT v FROM t ORDER BY v").expect("prepare");
        let rows = statement.query_map([], |row| row.get(0)).expect("query");
        rows.map(|row| row.expect("row")).collect()
    }

    #[test]
    fn a_write_alone_that_fails_after_writing_leaves_nothing_and_the_next_commits() {
        let conn = table();
        let (outcomes, delivered) = mpsc::channel();
        assert!(!run_batch(&conn, vec![insert(1, "fail", &outcomes)]));
        assert_eq!(delivered.try_recv().expect("answered").0, 1);
        assert!(conn.is_autocommit(), "the transaction is closed");
        assert!(run_batch(&conn, vec![insert(2, "ok", &outcomes)]));
        assert_eq!(delivered.try_recv().expect("answered"), (2, Ok(())));
        assert_eq!(values(&conn), vec![2]);
    }

    #[test]
    fn a_write_alone_that_panics_is_rolled_back_and_the_writer_goes_on() {
        let conn = table();
        let (outcomes, delivered) = mpsc::channel();
        assert!(!run_batch(&conn, vec![insert(1, "panic", &outcomes)]));
        assert!(
            delivered.try_recv().is_err(),
            "a panicked write answers nothing"
        );
        assert!(conn.is_autocommit(), "the transaction is closed");
        assert!(run_batch(&conn, vec![insert(2, "ok", &outcomes)]));
        assert_eq!(values(&conn), vec![2]);
    }

    #[test]
    fn in_a_batch_a_failed_or_panicked_write_is_undone_alone() {
        let conn = table();
        let (outcomes, delivered) = mpsc::channel();
        let batch = vec![
            insert(1, "ok", &outcomes),
            insert(2, "fail", &outcomes),
            insert(3, "panic", &outcomes),
            insert(4, "ok", &outcomes),
        ];
        assert!(run_batch(&conn, batch));
        let answered: Vec<i64> = delivered.try_iter().map(|(value, _)| value).collect();
        assert_eq!(answered, vec![1, 2, 4]);
        assert_eq!(values(&conn), vec![1, 4]);
        assert!(conn.is_autocommit(), "the transaction is closed");
    }

    #[test]
    fn a_batch_whose_every_write_failed_keeps_nothing() {
        let conn = table();
        let (outcomes, delivered) = mpsc::channel();
        let batch = vec![insert(1, "fail", &outcomes), insert(2, "fail", &outcomes)];
        assert!(!run_batch(&conn, batch));
        assert_eq!(delivered.try_iter().count(), 2);
        assert!(values(&conn).is_empty());
        assert!(conn.is_autocommit(), "the transaction is closed");
    }
}
