//! WAL checkpoints, on their own thread, and what they mean for the next
//! commit.
//!
//! A checkpoint copies the WAL back into the database file. Once it has
//! copied all of it, the next write transaction restarts the WAL from its
//! first frame and syncs the new WAL header, even with
//! `synchronous=NORMAL`. A write that runs on its caller's thread (a
//! runtime thread, see `writer.rs`) must not pay that fsync, so after such
//! a checkpoint the next write goes through the writer thread.
//!
//! A checkpoint run by another process on the same file is not seen here:
//! after one, a write on a caller's thread may still sync the WAL header
//! once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use rusqlite::Connection;

use crate::flow::store::StoreError;

/// How often the WAL is copied back into the database file.
pub(super) const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(1);

/// Whether the next commit may restart the WAL (and sync its header).
#[derive(Debug)]
pub(super) struct WalRestart {
    /// Checkpoints started so far (the first is 1).
    started: AtomicU64,
    /// A checkpoint is running now.
    running: AtomicBool,
    /// The checkpoint that left the WAL wholly copied, until a commit of
    /// the writer thread has restarted it; 0 for none.
    pending: AtomicU64,
}

impl Default for WalRestart {
    /// At open the WAL may be wholly copied (or empty): the first write
    /// restarts it.
    fn default() -> Self {
        Self {
            started: AtomicU64::new(1),
            running: AtomicBool::new(false),
            pending: AtomicU64::new(1),
        }
    }
}

impl WalRestart {
    /// When no restart can be due, a mark to check with [`Self::still`]
    /// once the write transaction has begun.
    pub(super) fn quiet_mark(&self) -> Option<u64> {
        let mark = self.started.load(SeqCst);
        (!self.running.load(SeqCst) && self.pending.load(SeqCst) == 0).then_some(mark)
    }

    /// Whether no checkpoint has run since `mark` was taken. SQLite decides
    /// whether a write transaction restarts the WAL when it begins, so a
    /// transaction begun with this true restarts nothing.
    pub(super) fn still(&self, mark: u64) -> bool {
        !self.running.load(SeqCst)
            && self.pending.load(SeqCst) == 0
            && self.started.load(SeqCst) == mark
    }

    /// The restart due now, read before a batch's transaction begins.
    pub(super) fn due(&self) -> u64 {
        self.pending.load(SeqCst)
    }

    /// A batch of the writer thread committed WAL frames, having begun when
    /// `due` was the restart due: that restart is done. One that a
    /// checkpoint made due since then stays. (A commit that changed no page
    /// writes no frame and restarts nothing.)
    pub(super) fn done(&self, due: u64) {
        if due != 0 {
            let _ = self.pending.compare_exchange(due, 0, SeqCst, SeqCst);
        }
    }

    /// Runs one passive checkpoint on `conn` (never blocking writers) and
    /// records whether it left the WAL wholly copied.
    pub(super) fn checkpoint(&self, conn: &Connection) {
        // Running first: a mark taken between the two stores is not one a
        // finished checkpoint can pass.
        self.running.store(true, SeqCst);
        let this = self.started.fetch_add(1, SeqCst) + 1;
        let result = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
            Ok((row.get::<_, i64>(1)?, row.get::<_, i64>(2)?))
        });
        match result {
            // Part of the WAL is still to copy: the next commit appends to it.
            Ok((log, copied)) if log > copied => {}
            Ok(_) => self.pending.store(this, SeqCst),
            Err(err) => {
                tracing::debug!(error = %err, "WAL checkpoint failed; will retry");
                self.pending.store(this, SeqCst);
            }
        }
        self.running.store(false, SeqCst);
    }
}

/// Copies the WAL back into the database file every `interval`, without
/// blocking writers; it stops when the returned sender is dropped (with
/// the writer thread).
pub(super) fn spawn_checkpointer(
    conn: Connection,
    restart: Arc<WalRestart>,
    interval: Duration,
) -> Result<mpsc::Sender<()>, StoreError> {
    let (alive, stopped) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("dexa-sqlite-checkpoint".to_string())
        .spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                restart.checkpoint(&conn);
            }
        })
        .map_err(|err| StoreError::Backend(format!("cannot start the checkpoint thread: {err}")))?;
    Ok(alive)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_made_due_while_a_batch_ran_stays_due_after_it() {
        let conn = Connection::open_in_memory().expect("open");
        let restart = WalRestart::default();
        assert_eq!(restart.quiet_mark(), None, "due at open");
        restart.done(restart.due());
        let mark = restart.quiet_mark().expect("nothing due");
        // A batch begins, a checkpoint copies the whole WAL meanwhile, and
        // the batch ends: the restart that checkpoint made due is not the
        // batch's to clear.
        let due = restart.due();
        restart.checkpoint(&conn);
        assert!(!restart.still(mark), "a checkpoint ran since the mark");
        restart.done(due);
        assert_eq!(restart.quiet_mark(), None, "still due");
        restart.done(restart.due());
        assert!(restart.quiet_mark().is_some());
    }
}
