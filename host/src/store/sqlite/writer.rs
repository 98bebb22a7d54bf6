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
    let committed = cached_execute(conn, "COMMIT", [])
        .map(|_| ())
        .map_err(|err| {
            let _ = conn.execute_batch("ROLLBACK");
            format!("commit failed: {err}")
        });
    // From BEGIN (which may wait for another process's write lock) to the
    // end of COMMIT (the fsync): what each write of the batch waited for.
    metrics::histogram!(crate::telemetry::SQLITE_BATCH_COMMIT)
        .record(began_at.elapsed().as_secs_f64());
    let wake = committed.is_ok() && done.iter().any(|d| d.wake);
    for result in done {
        (result.deliver)(committed.clone());
    }
    wake
}
