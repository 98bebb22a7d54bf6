//! The embedded SQLite backend: one file, WAL, shared by any number of
//! processes on one machine.
//!
//! - Writes of a process share one connection (`writer.rs`). A small write
//!   (`small.rs`) to a quiet store runs on its caller's thread when the
//!   store commits without an fsync; any other write is queued for the
//!   writer thread, which runs whatever is queued in one `BEGIN IMMEDIATE`
//!   transaction with a savepoint per write (group commit; a write queued
//!   alone needs none). Each write is answered only after its commit.
//!   Other processes wait on SQLite's lock (busy timeout 5 s); a write on
//!   its caller's thread never waits for them, it queues instead.
//! - Reads use their own connections, which WAL lets run beside writes.
//! - Between batches the writer polls `PRAGMA data_version` every 10 ms and
//!   wakes this process's workers when another process has committed;
//!   commits of this process wake them at once.
//! - Stream readers are woken by this process's appends at once, and by
//!   any commit that moved their flow's streams through a watch of its own
//!   (`stream_watch.rs`).
//! - WAL checkpoints run on their own thread, off the commit path.
//! - `synchronous=NORMAL` by default: in WAL mode a commit survives the death
//!   of any process (the crash model of workers) without an fsync per commit;
//!   an OS crash or power loss may lose the last commits but never corrupts
//!   the file. `synchronous=FULL` fsyncs every commit (see `dexa bench engine`
//!   for the cost).

mod catalog;
mod checkpoint;
mod claims;
mod connection;
mod dump;
mod flow_store;
mod flows;
mod history;
mod queue;
mod rpc;
mod schema;
mod small;
mod sql;
mod state;
mod stream_watch;
mod streams;
mod tasks;
mod writer;

use connection::{open_reader, open_writer};
pub use connection::{SqliteOptions, Synchronous};
use sql::{backend, now_millis};
use stream_watch::spawn_stream_watch;
use writer::{JobDone, Timing, WriteJob, Writer};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::{oneshot, Notify};

use crate::flow::store::StoreError;
use crate::flow::types::StoreMillis;
use crate::store::stream_signals::StreamSignals;

/// The default capacity of a stream, in bytes.
pub const DEFAULT_STREAM_CAPACITY: u64 = 10 << 20;

impl Inner {
    /// Runs `work` on a pooled read connection (a new one when none is free).
    fn with_reader<T, E, F>(&self, work: F) -> Result<T, E>
    where
        E: From<StoreError>,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, E>,
    {
        let pooled = self.readers.lock().ok().and_then(|mut pool| pool.pop());
        let conn = match pooled {
            Some(conn) => conn,
            None => open_reader(&self.path, &self.options)?,
        };
        let result = work(&conn, now_millis());
        if let Ok(mut pool) = self.readers.lock() {
            if pool.len() < 8 {
                pool.push(conn);
            }
        }
        result
    }
}

/// What a write may do, and where it may run.
#[derive(Clone, Copy, Debug)]
struct WriteKind {
    /// It may make a task ready: the workers are woken after its commit.
    wakes: bool,
    /// It is small (`small.rs`): it may run on its caller's thread.
    small: bool,
}

impl WriteKind {
    const WAKES: Self = Self {
        wakes: true,
        small: false,
    };
    const QUIET: Self = Self {
        wakes: false,
        small: false,
    };

    /// The same write, small when `small` says so.
    const fn small_if(self, small: bool) -> Self {
        Self {
            wakes: self.wakes,
            small,
        }
    }
}

/// The SQLite store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    options: SqliteOptions,
    writer: Writer,
    readers: Mutex<Vec<Connection>>,
    signal: Arc<Notify>,
    /// The readers of each flow's streams: woken by this process's appends
    /// at once, by any commit through the stream watch.
    streams: Arc<StreamSignals>,
    /// The Steps running for each flow: woken when its tasks are taken, by
    /// this process at once, by another through the watch.
    revocations: Arc<StreamSignals>,
    /// Test hook: refuse every write, as a full disk does.
    refuse_writes: AtomicBool,
    /// Test hook: the writes refused so far.
    refused_writes: AtomicU64,
}

impl SqliteStore {
    /// Opens (creating if needed) the store at `path`. Any number of
    /// processes may open one store at once; creating its schema waits its
    /// turn.
    pub fn open(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|err| {
                StoreError::Backend(format!("cannot create {}: {err}", parent.display()))
            })?;
        }
        let writer = open_writer(&path, &options)?;
        // Checkpoints (which fsync) run on their own thread, not after commits.
        writer.pragma_update(None, "wal_autocheckpoint", 0)?;
        let signal = Arc::new(Notify::new());
        let streams = Arc::new(StreamSignals::default());
        let revocations = Arc::new(StreamSignals::default());
        spawn_stream_watch(
            open_reader(&path, &options)?,
            Arc::downgrade(&streams),
            Arc::downgrade(&revocations),
        )?;
        let inline = options.synchronous == Synchronous::Normal;
        let checkpoints = open_reader(&path, &options)?;
        let writer = Writer::start(writer, checkpoints, inline, signal.clone(), Timing::DEFAULT)?;
        Ok(Self {
            inner: Arc::new(Inner {
                path,
                options,
                writer,
                readers: Mutex::new(Vec::new()),
                signal,
                streams,
                revocations,
                refuse_writes: AtomicBool::new(false),
                refused_writes: AtomicU64::new(0),
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Test support: a store in `dir` with `synchronous=NORMAL`, where small
    /// writes may run on their caller's thread.
    #[cfg(test)]
    pub(crate) fn open_normal_for_test(dir: &Path) -> Self {
        Self::open(
            dir.join("store.db"),
            SqliteOptions {
                synchronous: Synchronous::Normal,
            },
        )
        .unwrap_or_else(|err| panic!("cannot open a test store: {err}"))
    }

    /// Runs `work` in the writer's transaction and returns once it committed.
    /// `kind` says whether it can make a task ready and whether it is small.
    async fn write_job<T, E, F>(&self, kind: WriteKind, work: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, E> + Send + 'static,
    {
        if self.inner.refuse_writes.load(Ordering::Acquire) {
            self.inner.refused_writes.fetch_add(1, Ordering::AcqRel);
            return Err(E::from(backend(
                "database or disk is full (a test fault: refuse_writes_for_test)",
            )));
        }
        let (reply, answer) = oneshot::channel::<Result<T, E>>();
        let job: WriteJob = Box::new(move |conn, now| {
            let result = match conn {
                Ok(conn) => work(conn, now),
                Err(reason) => Err(E::from(StoreError::Backend(reason))),
            };
            let ok = result.is_ok();
            JobDone {
                ok,
                wake: kind.wakes && ok,
                deliver: Box::new(move |committed| {
                    let outcome = match (result, committed) {
                        (Ok(value), Ok(())) => Ok(value),
                        (Ok(_), Err(reason)) => Err(E::from(StoreError::Backend(reason))),
                        (Err(err), _) => Err(err),
                    };
                    let _ = reply.send(outcome);
                }),
            }
        });
        self.inner
            .writer
            .run(job, kind.small)
            .map_err(|reason| E::from(backend(reason)))?;
        answer
            .await
            .map_err(|_| E::from(backend("the SQLite writer thread dropped a write")))?
    }

    /// A write that may make tasks ready.
    async fn write<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, StoreError> + Send + 'static,
    {
        self.write_job(WriteKind::WAKES, work).await
    }

    /// A write of the given kind, failing with a [`StoreError`].
    async fn write_as<T, F>(&self, kind: WriteKind, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, StoreError> + Send + 'static,
    {
        self.write_job(kind, work).await
    }

    /// A write that makes no task ready (claims, lease renewals).
    async fn write_quietly<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, StoreError> + Send + 'static,
    {
        self.write_job(WriteKind::QUIET, work).await
    }

    /// Runs `work` on a pooled read connection, inline on the calling task.
    /// The reads are indexed lookups of one flow's rows (microseconds), and
    /// WAL readers never wait for writers, so a hop to a blocking thread
    /// would cost more than the read.
    async fn read<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, StoreError> + Send + 'static,
    {
        self.inner.with_reader(work)
    }

    /// Runs `work` on a pooled read connection, like [`Self::read`], but on a
    /// blocking thread: for reads that can be large (a turn's whole history,
    /// a snapshot of 200 messages) or long (a read transaction that waits
    /// out a WAL checkpoint's lock), which must not stall a runtime thread
    /// that other sessions' tasks share.
    async fn read_blocking<T, E, F>(&self, work: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, E> + Send + 'static,
    {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || inner.with_reader(work))
            .await
            .map_err(|err| E::from(backend(format!("a blocking read did not finish: {err}"))))?
    }

    /// Test hook: occupies this store's writer thread for `hold`, inside its
    /// write transaction, as a slow commit or a stalled disk would; returns
    /// once the writer is held. Every write queued meanwhile waits; reads
    /// must not.
    #[doc(hidden)]
    pub async fn hold_writer_for_test(&self, hold: Duration) -> Result<(), StoreError> {
        let (started, held) = oneshot::channel::<()>();
        let job: WriteJob = Box::new(move |_conn, _now| {
            let _ = started.send(());
            std::thread::sleep(hold);
            JobDone {
                ok: true,
                wake: false,
                deliver: Box::new(|_| {}),
            }
        });
        self.inner.writer.queue(job).map_err(backend)?;
        held.await
            .map_err(|_| backend("the SQLite writer dropped the hold"))
    }

    /// Test hook: while `refuse` holds, every write of this handle fails as
    /// on a full disk ("database or disk is full"); reads still work.
    #[doc(hidden)]
    pub fn refuse_writes_for_test(&self, refuse: bool) {
        self.inner.refuse_writes.store(refuse, Ordering::Release);
    }

    /// Test hook: how many writes [`Self::refuse_writes_for_test`] refused.
    #[doc(hidden)]
    pub fn refused_writes_for_test(&self) -> u64 {
        self.inner.refused_writes.load(Ordering::Acquire)
    }
}
