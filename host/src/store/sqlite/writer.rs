//! The write connection: every write of this process runs on it, on its
//! caller's thread when it is free, else queued for the writer thread,
//! which runs what is queued in batches (group commit) and watches for
//! other processes' commits.

use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rusqlite::hooks::Wal;
use rusqlite::Connection;
use tokio::sync::Notify;

use super::checkpoint::{spawn_checkpointer, WalRestart, CHECKPOINT_INTERVAL};
use super::connection::BUSY_TIMEOUT;
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

/// The process's one write connection, and the writes queued for it.
///
/// A small write to a quiet store runs on its caller's thread: handing it
/// to the writer thread costs two thread wake-ups per commit (the writer's,
/// then the caller's), 70 to 200 µs each on this project's 2-core machine,
/// at about eight commits a benchmark turn. When the connection is busy,
/// writes are queued or the store is under load (see [`GROUPING`]), a
/// write joins the queue, and the writer thread runs whatever is queued as
/// one batch (group commit), so a burst of writes still shares commits.
pub(super) struct Writer {
    shared: Arc<Shared>,
    jobs: Mutex<mpsc::Sender<WriteJob>>,
    /// Whether a write may run on its caller's thread: only when a commit
    /// does not fsync (`synchronous=NORMAL`), since the caller is a runtime
    /// thread other sessions share.
    inline: bool,
    signal: Arc<Notify>,
}

/// What the writer thread and the callers' threads share.
struct Shared {
    conn: Mutex<Connection>,
    /// Writes sent to the writer thread and not yet taken into a batch:
    /// while any wait, every write queues behind them, so the queue is
    /// never starved by writes that run on their callers' threads.
    queued: AtomicUsize,
    /// Until when (in microseconds from `started`) writes queue even when
    /// the connection is free: set after each batch of more than one
    /// write, the sign of a store under load.
    grouping_until: AtomicU64,
    /// Whether the next commit may restart the WAL, and so fsync.
    restart: Arc<WalRestart>,
    /// Set by SQLite's WAL hook when a commit of the connection wrote WAL
    /// frames (a commit that changed no page writes none).
    wrote_frames: Arc<AtomicBool>,
    timing: Timing,
    started: Instant,
}

/// The writer's intervals: [`Timing::DEFAULT`], or long ones in tests, so
/// that nothing runs on its own while a test looks.
#[derive(Clone, Copy, Debug)]
pub(super) struct Timing {
    /// See [`GROUPING`].
    grouping: Duration,
    /// How often the writer thread looks for other processes' commits.
    watch: Duration,
    /// How often the WAL is checkpointed.
    checkpoint: Duration,
}

impl Timing {
    pub(super) const DEFAULT: Self = Self {
        grouping: GROUPING,
        watch: WATCH_INTERVAL,
        checkpoint: CHECKPOINT_INTERVAL,
    };
}

/// How long after the writer thread ran a batch of several writes every
/// write still queues. Under load, writes meet in the queue, the writer
/// thread's batches hold several, and so writes keep sharing commits (and
/// runtime threads keep serving sessions, not writing) for as long as the
/// load lasts. A write to a quiet store skips two thread wake-ups.
const GROUPING: Duration = Duration::from_micros(300);

impl Shared {
    fn micros(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Whether a write may run on its caller's thread now: nothing is
    /// queued, no batch of several ran lately, and no WAL restart is due.
    /// Returns the checkpoint mark to check once the transaction has begun.
    fn quiet(&self) -> Option<u64> {
        if self.queued.load(Ordering::Acquire) > 0
            || self.micros() < self.grouping_until.load(Ordering::Acquire)
        {
            return None;
        }
        self.restart.quiet_mark()
    }
}

impl Writer {
    /// Starts the writer thread on `conn`, and the checkpointer on
    /// `checkpoints`, which stops with it. `signal` is notified after a
    /// commit that may have made work ready, and when another process
    /// commits.
    pub(super) fn start(
        mut conn: Connection,
        checkpoints: Connection,
        inline: bool,
        signal: Arc<Notify>,
        timing: Timing,
    ) -> Result<Self, StoreError> {
        let restart = Arc::new(WalRestart::default());
        let checkpointer = spawn_checkpointer(checkpoints, restart.clone(), timing.checkpoint)?;
        let data_version = data_version(&conn);
        // Registered after `SqliteStore::open` set `wal_autocheckpoint`,
        // which replaces the connection's WAL hook.
        let wrote_frames = Arc::new(AtomicBool::new(false));
        conn.wal_hook(Some({
            let wrote_frames = wrote_frames.clone();
            move |_: &mut Wal, _frames: c_int| {
                wrote_frames.store(true, Ordering::Release);
                Ok(())
            }
        }))?;
        let shared = Arc::new(Shared {
            conn: Mutex::new(conn),
            queued: AtomicUsize::new(0),
            grouping_until: AtomicU64::new(0),
            restart,
            wrote_frames,
            timing,
            started: Instant::now(),
        });
        let (jobs, queue) = mpsc::channel();
        std::thread::Builder::new()
            .name("dexa-sqlite-writer".to_string())
            .spawn({
                let shared = shared.clone();
                let signal = signal.clone();
                move || run_writer(&shared, queue, &signal, data_version, checkpointer)
            })
            .map_err(|err| StoreError::Backend(format!("cannot start the writer thread: {err}")))?;
        Ok(Self {
            shared,
            jobs: Mutex::new(jobs),
            inline,
            signal,
        })
    }

    /// Runs `job` on this thread when it is `small` (see `small.rs`) and
    /// the store is quiet; queues it for the writer thread otherwise.
    pub(super) fn run(&self, job: WriteJob, small: bool) -> Result<(), String> {
        if !small {
            return self.queue(job);
        }
        match self.try_run_here(job) {
            Ok(wake) => {
                if wake {
                    self.signal.notify_waiters();
                }
                Ok(())
            }
            Err(job) => self.queue(job),
        }
    }

    /// Whether a small write would try to run on its caller's thread now
    /// (the store is quiet): a caller that must read before it knows
    /// whether its write is small skips the read when the write would
    /// queue anyway.
    pub(super) fn may_run_here(&self) -> bool {
        self.inline && self.shared.quiet().is_some()
    }

    /// Queues `job` for the writer thread.
    pub(super) fn queue(&self, job: WriteJob) -> Result<(), String> {
        let jobs = self
            .jobs
            .lock()
            .map_err(|_| "the writer queue is poisoned".to_string())?;
        self.shared.queued.fetch_add(1, Ordering::AcqRel);
        jobs.send(job).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
            "the SQLite writer thread has stopped".to_string()
        })
    }

    /// Runs `job` as a batch of its own, here, or hands it back when it
    /// must queue: writes are queued, the connection is busy, or another
    /// process holds the store's write lock (a runtime thread must not wait
    /// out the busy timeout; the writer thread does).
    fn try_run_here(&self, job: WriteJob) -> Result<bool, WriteJob> {
        if !self.may_run_here() {
            return Err(job);
        }
        let Ok(conn) = self.shared.conn.try_lock() else {
            return Err(job);
        };
        // Again with the connection held: the writer thread may have run a
        // batch of several between the first look and the lock.
        let Some(mark) = self.shared.quiet() else {
            return Err(job);
        };
        let began_at = Instant::now();
        if conn.busy_timeout(Duration::ZERO).is_err() {
            return Err(job);
        }
        let began = cached_execute(&conn, "BEGIN IMMEDIATE", []);
        let restored = conn.busy_timeout(BUSY_TIMEOUT);
        match (began, restored) {
            (Ok(_), Ok(())) if self.shared.restart.still(mark) => {
                Ok(run_begun(&conn, vec![job], began_at).unwrap_or(false))
            }
            // A checkpoint ran since the mark: this transaction may restart
            // the WAL (and fsync), so it is the writer thread's.
            (Ok(_), _) => {
                rollback(&conn);
                Err(job)
            }
            (Err(_), _) => Err(job),
        }
    }
}

/// The writer thread: runs queued writes in batches (one transaction, a
/// savepoint per write, one commit), and between batches watches
/// `data_version`, which changes only when another process commits, to
/// wake this process's workers. It stops when the [`Writer`] is dropped.
fn run_writer(
    shared: &Shared,
    queue: mpsc::Receiver<WriteJob>,
    signal: &Notify,
    mut last_version: Option<i64>,
    // Dropped with this thread, which stops the checkpointer.
    _checkpointer: mpsc::Sender<()>,
) {
    let watch = shared.timing.watch;
    let mut last_check = Instant::now();
    loop {
        match queue.recv_timeout(watch) {
            Ok(first) => {
                let conn = lock(&shared.conn);
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match queue.try_recv() {
                        Ok(job) => batch.push(job),
                        Err(_) => break,
                    }
                }
                shared.queued.fetch_sub(batch.len(), Ordering::AcqRel);
                let grouped = batch.len() > 1;
                let due = shared.restart.due();
                shared.wrote_frames.store(false, Ordering::Release);
                let committed = run_batch(&conn, batch);
                if committed.is_some() && shared.wrote_frames.load(Ordering::Acquire) {
                    shared.restart.done(due);
                }
                if grouped {
                    let grouping =
                        u64::try_from(shared.timing.grouping.as_micros()).unwrap_or(u64::MAX);
                    let until = shared.micros().saturating_add(grouping);
                    shared.grouping_until.store(until, Ordering::Release);
                }
                // Released only now: a write that finds it free sees the
                // grouping just set.
                drop(conn);
                if committed == Some(true) {
                    signal.notify_waiters();
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if last_check.elapsed() >= watch {
            // A write running on its caller's thread holds the connection;
            // the watch looks again on the next round.
            if let Ok(conn) = shared.conn.try_lock() {
                last_check = Instant::now();
                let version = data_version(&conn);
                if version != last_version {
                    last_version = version;
                    signal.notify_waiters();
                }
            }
        }
    }
}

/// The write connection, even after a panic while it was held (a write's
/// own panic is caught inside its batch): an open transaction left behind
/// is rolled back, so that the next batch can begin.
fn lock(conn: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    let guard = conn.lock().unwrap_or_else(|poisoned| {
        conn.clear_poison();
        poisoned.into_inner()
    });
    if !guard.is_autocommit() {
        rollback(&guard);
    }
    guard
}

/// What `PRAGMA data_version` says now: it changes when another
/// connection commits.
fn data_version(conn: &Connection) -> Option<i64> {
    conn.query_row("PRAGMA data_version", [], |row| row.get(0))
        .ok()
}

/// Runs one batch: `None` when nothing was committed, else whether a
/// committed write may have made work ready.
fn run_batch(conn: &Connection, batch: Vec<WriteJob>) -> Option<bool> {
    let began_at = Instant::now();
    if let Err(err) = cached_execute(conn, "BEGIN IMMEDIATE", []) {
        let reason = format!("cannot begin a write transaction: {err}");
        let now = now_millis();
        for job in batch {
            (job(Err(reason.clone()), now).deliver)(Err(reason.clone()));
        }
        return None;
    }
    run_begun(conn, batch, began_at)
}

/// Runs a batch in the transaction just begun, and commits it (see
/// [`run_batch`] for what it returns).
fn run_begun(conn: &Connection, batch: Vec<WriteJob>, began_at: Instant) -> Option<bool> {
    metrics::histogram!(crate::telemetry::SQLITE_BATCH_WRITES).record(batch.len() as f64);
    // The clock is read once the write lock is held: BEGIN may wait up to
    // the busy timeout for another process, and a time read before it
    // would shorten every lease the batch grants and misjudge expiries.
    let now = now_millis();
    let done = if batch.len() == 1 {
        run_alone(conn, batch, now)
    } else {
        run_in_savepoints(conn, batch, now)
    };
    let keep = done.iter().any(|d| d.ok);
    let committed = if keep {
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
    let kept = keep && committed.is_ok();
    let wake = kept && done.iter().any(|d| d.ok && d.wake);
    for result in done {
        (result.deliver)(committed.clone());
    }
    kept.then_some(wake)
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
        assert_eq!(run_batch(&conn, vec![insert(1, "fail", &outcomes)]), None);
        assert_eq!(delivered.try_recv().expect("answered").0, 1);
        assert!(conn.is_autocommit(), "the transaction is closed");
        assert_eq!(
            run_batch(&conn, vec![insert(2, "ok", &outcomes)]),
            Some(true)
        );
        assert_eq!(delivered.try_recv().expect("answered"), (2, Ok(())));
        assert_eq!(values(&conn), vec![2]);
    }

    #[test]
    fn a_write_alone_that_panics_is_rolled_back_and_the_writer_goes_on() {
        let conn = table();
        let (outcomes, delivered) = mpsc::channel();
        assert_eq!(run_batch(&conn, vec![insert(1, "panic", &outcomes)]), None);
        assert!(
            delivered.try_recv().is_err(),
            "a panicked write answers nothing"
        );
        assert!(conn.is_autocommit(), "the transaction is closed");
        assert_eq!(
            run_batch(&conn, vec![insert(2, "ok", &outcomes)]),
            Some(true)
        );
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
        assert_eq!(run_batch(&conn, batch), Some(true));
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
        assert_eq!(run_batch(&conn, batch), None);
        assert_eq!(delivered.try_iter().count(), 2);
        assert!(values(&conn).is_empty());
        assert!(conn.is_autocommit(), "the transaction is closed");
    }

    /// A write of one row (so its commit writes WAL frames) that reports
    /// the thread it ran on and the commit's outcome.
    fn where_it_ran(ran: &mpsc::Sender<(std::thread::ThreadId, Result<(), String>)>) -> WriteJob {
        let ran = ran.clone();
        Box::new(move |conn, _now| {
            let ok = conn.is_ok_and(|conn| conn.execute("INSERT INTO t VALUES (1)", []).is_ok());
            let thread = std::thread::current().id();
            JobDone {
                ok,
                wake: false,
                deliver: Box::new(move |committed| {
                    let _ = ran.send((thread, committed));
                }),
            }
        })
    }

    /// Intervals long enough that nothing runs on its own while a test
    /// looks, however slow the machine.
    const STILL: Timing = Timing {
        grouping: Duration::from_secs(600),
        watch: Duration::from_secs(600),
        checkpoint: Duration::from_secs(600),
    };

    fn writer_on_file(dir: &std::path::Path, inline: bool) -> Writer {
        let timing = Timing {
            grouping: GROUPING,
            ..STILL
        };
        writer_with(dir, inline, timing)
    }

    fn writer_with(dir: &std::path::Path, inline: bool, timing: Timing) -> Writer {
        let path = dir.join("store.db");
        let conn = Connection::open(&path).expect("open");
        conn.pragma_update(None, "journal_mode", "WAL")
            .expect("wal");
        conn.busy_timeout(BUSY_TIMEOUT).expect("busy timeout");
        conn.execute_batch("CREATE TABLE IF NOT EXISTS t (v INTEGER)")
            .expect("create");
        let checkpoints = Connection::open(&path).expect("open");
        let signal = Arc::new(Notify::new());
        Writer::start(conn, checkpoints, inline, signal, timing).expect("start")
    }

    /// Runs a write through the writer thread and waits until it let go of
    /// the connection: the WAL restart due at open is done.
    fn settle(writer: &Writer) {
        let (ran, reports) = mpsc::channel();
        writer.queue(where_it_ran(&ran)).expect("queue");
        assert_eq!(reports.recv().expect("ran").1, Ok(()));
        drop(lock(&writer.shared.conn));
    }

    /// A job that holds the writer thread until released.
    fn holding(started: mpsc::Sender<()>, released: mpsc::Receiver<()>) -> WriteJob {
        Box::new(move |_conn, _now| {
            let _ = started.send(());
            let _ = released.recv_timeout(Duration::from_secs(30));
            JobDone {
                ok: true,
                wake: false,
                deliver: Box::new(|_| {}),
            }
        })
    }

    /// Under load, writes keep meeting in the queue: after a batch of
    /// several, a write queues even though the connection is free.
    #[test]
    fn after_a_batch_of_several_writes_a_small_write_still_queues() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Long enough that the check cannot outlast it on a slow machine.
        let writer = writer_with(dir.path(), true, STILL);
        let (started, running) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        writer.queue(holding(started, released)).expect("queue");
        running.recv().expect("the batch runs");
        let (ran, reports) = mpsc::channel();
        // Two writes meet in the queue behind the running batch.
        writer.queue(where_it_ran(&ran)).expect("queue");
        writer.queue(where_it_ran(&ran)).expect("queue");
        release.send(()).expect("release");
        for _ in 0..2 {
            assert_eq!(reports.recv().expect("ran").1, Ok(()));
        }
        // Wait until the batch of two released the connection.
        drop(lock(&writer.shared.conn));
        writer.run(where_it_ran(&ran), true).expect("run");
        let (thread, committed) = reports.recv().expect("ran");
        assert_ne!(
            thread,
            std::thread::current().id(),
            "it ran here under load"
        );
        assert_eq!(committed, Ok(()));
    }

    #[test]
    fn a_small_write_to_a_quiet_store_runs_on_its_callers_thread_and_a_large_one_queues() {
        let dir = tempfile::tempdir().expect("tempdir");
        let writer = writer_on_file(dir.path(), true);
        settle(&writer);
        let here = std::thread::current().id();
        let (ran, reports) = mpsc::channel();
        writer.run(where_it_ran(&ran), true).expect("run");
        assert_eq!(reports.recv().expect("ran"), (here, Ok(())));
        writer.run(where_it_ran(&ran), false).expect("run");
        let (thread, committed) = reports.recv().expect("ran");
        assert_ne!(thread, here, "a large write ran on its caller's thread");
        assert_eq!(committed, Ok(()));
    }

    #[test]
    fn with_fsync_per_commit_every_write_queues() {
        let dir = tempfile::tempdir().expect("tempdir");
        let writer = writer_on_file(dir.path(), false);
        settle(&writer);
        let (ran, reports) = mpsc::channel();
        writer.run(where_it_ran(&ran), true).expect("run");
        let (thread, committed) = reports.recv().expect("ran");
        assert_ne!(thread, std::thread::current().id());
        assert_eq!(committed, Ok(()));
    }

    #[test]
    fn a_small_write_queues_behind_a_batch_the_writer_thread_is_running() {
        let dir = tempfile::tempdir().expect("tempdir");
        let writer = writer_on_file(dir.path(), true);
        settle(&writer);
        let (started, running) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        writer.queue(holding(started, released)).expect("queue");
        running.recv().expect("the batch runs");
        let (ran, reports) = mpsc::channel();
        writer.run(where_it_ran(&ran), true).expect("run");
        assert!(reports.try_recv().is_err(), "it ran past the running batch");
        release.send(()).expect("release");
        let (thread, committed) = reports.recv().expect("ran");
        assert_ne!(thread, std::thread::current().id());
        assert_eq!(committed, Ok(()));
    }

    /// Another process's write lock is never waited out on the caller's
    /// thread (a runtime thread): the write queues for the writer thread.
    /// Had the caller waited (up to the busy timeout), the holder's own
    /// release after four seconds (inside the 5 s busy timeout) would let
    /// the write run here. Only a caller stalled for four seconds between
    /// taking the lock and writing could fail it spuriously; a correct
    /// write never waits for that release.
    #[test]
    fn a_small_write_does_not_wait_on_its_callers_thread_for_another_processs_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let writer = writer_on_file(dir.path(), true);
        settle(&writer);
        let other = Connection::open(dir.path().join("store.db")).expect("open");
        let (held, holding) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            other.execute_batch("BEGIN IMMEDIATE").expect("lock");
            let _ = held.send(());
            let _ = released.recv_timeout(BUSY_TIMEOUT - Duration::from_secs(1));
            other.execute_batch("COMMIT").expect("unlock");
        });
        holding.recv().expect("held");
        let (ran, reports) = mpsc::channel();
        writer.run(where_it_ran(&ran), true).expect("run");
        let _ = release.send(());
        let (thread, committed) = reports.recv().expect("ran");
        assert_ne!(
            thread,
            std::thread::current().id(),
            "it waited for the lock here"
        );
        assert_eq!(committed, Ok(()));
        holder.join().expect("holder");
    }

    /// After a checkpoint that copied the whole WAL, the next commit
    /// restarts the WAL and syncs its header, even with
    /// `synchronous=NORMAL`: that write goes through the writer thread, and
    /// the one after it runs on its caller's thread again.
    #[test]
    fn after_a_checkpoint_that_copied_the_whole_wal_the_next_write_queues() {
        let dir = tempfile::tempdir().expect("tempdir");
        let writer = writer_on_file(dir.path(), true);
        settle(&writer);
        let here = std::thread::current().id();
        let (ran, reports) = mpsc::channel();
        writer.run(where_it_ran(&ran), true).expect("run");
        assert_eq!(reports.recv().expect("ran"), (here, Ok(())));
        let other = Connection::open(dir.path().join("store.db")).expect("open");
        writer.shared.restart.checkpoint(&other);
        // A commit that changed nothing writes no WAL frame and so restarts
        // nothing: the restart is still due after it.
        let (nothing, done) = mpsc::channel();
        writer
            .queue(Box::new(move |_conn, _now| JobDone {
                ok: true,
                wake: false,
                deliver: Box::new(move |committed| {
                    let _ = nothing.send(committed);
                }),
            }))
            .expect("queue");
        assert_eq!(done.recv().expect("committed"), Ok(()));
        drop(lock(&writer.shared.conn));
        writer.run(where_it_ran(&ran), true).expect("run");
        let (thread, committed) = reports.recv().expect("ran");
        assert_ne!(thread, here, "the WAL restart ran on the caller's thread");
        assert_eq!(committed, Ok(()));
        drop(lock(&writer.shared.conn));
        writer.run(where_it_ran(&ran), true).expect("run");
        assert_eq!(reports.recv().expect("ran"), (here, Ok(())));
    }
}
