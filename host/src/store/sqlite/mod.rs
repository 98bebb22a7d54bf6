//! The embedded SQLite backend: one file, WAL, shared by any number of
//! processes on one machine.
//!
//! - Writes of a process go through one writer thread, which runs whatever is
//!   queued in one `BEGIN IMMEDIATE` transaction with a savepoint per write
//!   (group commit) and answers each write only after the commit. Other
//!   processes wait on SQLite's lock (busy timeout 5 s).
//! - Reads use their own connections, which WAL lets run beside writes.
//! - Between batches the writer polls `PRAGMA data_version` every 10 ms and
//!   wakes this process's workers when another process has committed;
//!   commits of this process wake them at once.
//! - WAL checkpoints run on their own thread, off the commit path.
//! - `synchronous=NORMAL` by default: in WAL mode a commit survives the death
//!   of any process (the crash model of workers) without an fsync per commit;
//!   an OS crash or power loss may lose the last commits but never corrupts
//!   the file. `synchronous=FULL` fsyncs every commit (see `dexa bench engine`
//!   for the cost).

mod catalog;
mod connection;
mod schema;
mod state;
mod streams;
mod writer;

use connection::{open_reader, open_writer};
pub use connection::{SqliteOptions, Synchronous};
use writer::{run_writer, spawn_checkpointer, JobDone, WriteJob};

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension};
use tokio::sync::{oneshot, Notify};

use crate::flow::store::{
    AttemptFailure, ExpiredLease, FailureAction, FlowStore, RpcBody, RpcError, StateAnswer,
    StateQuery, StepCommit, StoreError,
};
use crate::flow::types::{
    ClaimedTask, FlowInfo, FlowStatus, Json, MapQuery, NewTask, StepHistoryEntry, StoreMillis,
    StreamPage, Versioned,
};

use state::SqliteStateTx;

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

/// The SQLite store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    options: SqliteOptions,
    writer: Mutex<mpsc::Sender<WriteJob>>,
    readers: Mutex<Vec<Connection>>,
    signal: Arc<Notify>,
}

pub(crate) fn backend(err: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(err.to_string())
}

pub(crate) fn now_millis() -> StoreMillis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `execute` through the connection's statement cache.
pub(crate) fn cached_execute(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute(params)
}

/// `query_row` through the connection's statement cache.
pub(crate) fn cached_query_row<T>(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
    f: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    conn.prepare_cached(sql)?.query_row(params, f)
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
        writer
            .pragma_update(None, "wal_autocheckpoint", 0)
            .map_err(backend)?;
        let checkpoints = spawn_checkpointer(open_reader(&path, &options)?)?;
        let signal = Arc::new(Notify::new());
        let (jobs, queue) = mpsc::channel();
        std::thread::Builder::new()
            .name("dexa-sqlite-writer".to_string())
            .spawn({
                let signal = signal.clone();
                move || run_writer(writer, queue, signal, checkpoints)
            })
            .map_err(|err| StoreError::Backend(format!("cannot start the writer thread: {err}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                path,
                options,
                writer: Mutex::new(jobs),
                readers: Mutex::new(Vec::new()),
                signal,
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `work` in the writer's transaction and returns once it committed.
    /// `wake` says whether it can make a task ready.
    async fn write_job<T, E, F>(&self, wake: bool, work: F) -> Result<T, E>
    where
        T: Send + 'static,
        E: From<StoreError> + Send + 'static,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, E> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel::<Result<T, E>>();
        let job: WriteJob = Box::new(move |conn, now| {
            let result = match conn {
                Ok(conn) => work(conn, now),
                Err(reason) => Err(E::from(StoreError::Backend(reason))),
            };
            let ok = result.is_ok();
            JobDone {
                ok,
                wake: wake && ok,
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
        let sent = self
            .inner
            .writer
            .lock()
            .map_err(|_| E::from(backend("the writer queue is poisoned")))?
            .send(job);
        if sent.is_err() {
            return Err(E::from(backend("the SQLite writer thread has stopped")));
        }
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
        self.write_job(true, work).await
    }

    /// A write that makes no task ready (claims, lease renewals).
    async fn write_quietly<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, StoreMillis) -> Result<T, StoreError> + Send + 'static,
    {
        self.write_job(false, work).await
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
        self.inner
            .writer
            .lock()
            .map_err(|_| backend("the writer queue is poisoned"))?
            .send(job)
            .map_err(|_| backend("the SQLite writer thread has stopped"))?;
        held.await
            .map_err(|_| backend("the SQLite writer dropped the hold"))
    }
}

fn in_list(count: usize) -> String {
    vec!["?"; count].join(",")
}

fn flow_row(
    row: &rusqlite::Row<'_>,
) -> rusqlite::Result<(String, String, String, i64, i64, Option<String>)> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        row.get(3)?,
        row.get(4)?,
        row.get(5)?,
    ))
}

fn to_flow_info(
    (flow_id, flow_type, status, created_at, updated_at, error): (
        String,
        String,
        String,
        i64,
        i64,
        Option<String>,
    ),
) -> Result<FlowInfo, StoreError> {
    let status = FlowStatus::parse(&status)
        .ok_or_else(|| StoreError::Corrupt(format!("flow {flow_id} has status {status:?}")))?;
    Ok(FlowInfo {
        flow_id,
        flow_type,
        status,
        created_at,
        updated_at,
        error,
    })
}

const FLOW_COLUMNS: &str = "flow_id, flow_type, status, created_at_ms, updated_at_ms, error";

#[async_trait]
impl FlowStore for SqliteStore {
    async fn now(&self) -> Result<StoreMillis, StoreError> {
        Ok(now_millis())
    }

    fn work_signal(&self) -> Arc<Notify> {
        self.inner.signal.clone()
    }

    async fn create_flow(
        &self,
        flow_id: &str,
        flow_type: &str,
        first: NewTask,
    ) -> Result<(), StoreError> {
        let (flow_id, flow_type) = (flow_id.to_string(), flow_type.to_string());
        self.write(move |tx, now| {
            let inserted = cached_execute(
                tx,
                "INSERT INTO flows (flow_id, flow_type, status, created_at_ms, updated_at_ms)
                     VALUES (?1, ?2, 'running', ?3, ?3) ON CONFLICT (flow_id) DO NOTHING",
                params![flow_id, flow_type, now],
            )
            .map_err(backend)?;
            if inserted == 0 {
                return Err(StoreError::FlowExists { flow_id });
            }
            state::insert_task(tx, &flow_id, &flow_type, &first)?;
            Ok(())
        })
        .await
    }

    async fn flow(&self, flow_id: &str) -> Result<Option<FlowInfo>, StoreError> {
        let flow_id = flow_id.to_string();
        self.read(move |conn, _| state::flow_info(conn, &flow_id))
            .await
    }

    async fn list_flows(
        &self,
        flow_type: Option<&str>,
        limit: usize,
    ) -> Result<Vec<FlowInfo>, StoreError> {
        let flow_type = flow_type.map(str::to_string);
        self.read(move |conn, _| {
            let mut stmt = conn
                .prepare(&format!(
                    "SELECT {FLOW_COLUMNS} FROM flows WHERE (?1 IS NULL OR flow_type = ?1)
                     ORDER BY created_at_ms DESC, flow_id LIMIT ?2"
                ))
                .map_err(backend)?;
            let rows = stmt
                .query_map(params![flow_type, limit as i64], flow_row)
                .map_err(backend)?
                .collect::<Result<Vec<_>, _>>()
                .map_err(backend)?;
            rows.into_iter().map(to_flow_info).collect()
        })
        .await
    }

    async fn stop_flow(&self, flow_id: &str) -> Result<bool, StoreError> {
        let flow_id = flow_id.to_string();
        self.write(move |tx, now| {
            let stopped = cached_execute(
                tx,
                "UPDATE flows SET status = 'stopped', updated_at_ms = ?2
                     WHERE flow_id = ?1 AND status = 'running'",
                params![flow_id, now],
            )
            .map_err(backend)?;
            if stopped > 0 {
                state::drop_tasks(tx, &flow_id)?;
            }
            Ok(stopped > 0)
        })
        .await
    }

    async fn claim(
        &self,
        worker_id: &str,
        flow_types: &[String],
        max: usize,
        lease_ms: i64,
    ) -> Result<Vec<ClaimedTask>, StoreError> {
        if flow_types.is_empty() || max == 0 {
            return Ok(Vec::new());
        }
        // Most looks find nothing; a read says so without taking the writer.
        // A task made ready after this read wakes the worker again.
        let probe = flow_types.to_vec();
        if !self
            .read(move |conn, now| state::any_claimable(conn, now, &probe))
            .await?
        {
            return Ok(Vec::new());
        }
        let worker_id = worker_id.to_string();
        let flow_types = flow_types.to_vec();
        self.write_quietly(move |tx, now| {
            state::claim(
                tx,
                now,
                &worker_id,
                state::ClaimScope::FlowTypes(&flow_types),
                max,
                lease_ms,
            )
        })
        .await
    }

    async fn renew_leases(
        &self,
        worker_id: &str,
        held: &[(i64, i64)],
        lease_ms: i64,
    ) -> Result<Vec<(i64, i64)>, StoreError> {
        let worker_id = worker_id.to_string();
        let held = held.to_vec();
        self.write_quietly(move |tx, now| {
            let mut lost = Vec::new();
            let mut stmt = tx
                .prepare_cached(
                    "UPDATE tasks SET lease_expires_ms = ?1
                     WHERE task_id = ?2 AND lease_token = ?3 AND state = 'leased' AND lease_owner = ?4",
                )
                .map_err(backend)?;
            for (task_id, token) in held {
                let renewed = stmt.execute(params![now + lease_ms, task_id, token, worker_id])
                    .map_err(backend)?;
                if renewed == 0 {
                    lost.push((task_id, token));
                }
            }
            Ok(lost)
        })
        .await
    }

    async fn record_output(&self, task_id: i64, lease_token: i64) -> Result<(), StoreError> {
        self.write_quietly(move |tx, now| state::record_output(tx, now, task_id, lease_token))
            .await
    }

    async fn commit_step(&self, commit: StepCommit) -> Result<Vec<ClaimedTask>, StoreError> {
        self.write(move |tx, now| {
            let claim_next = commit.claim_next.clone();
            let flow_id = commit.flow_id.clone();
            state::commit_step(tx, now, commit)?;
            match claim_next {
                Some(next) if next.max > 0 => state::claim(
                    tx,
                    now,
                    &next.worker_id,
                    state::ClaimScope::Flow(&flow_id),
                    next.max,
                    next.lease_ms,
                ),
                _ => Ok(Vec::new()),
            }
        })
        .await
    }

    async fn fail_attempt(&self, failure: AttemptFailure) -> Result<(), StoreError> {
        self.write(move |tx, now| {
            state::check_lease(tx, failure.task_id, failure.lease_token, failure.require_expired.then_some(now))?;
            state::insert_history(tx, &failure.flow_id, &failure.history)?;
            cached_execute(tx, "DELETE FROM state_locks WHERE task_id = ?1", params![failure.task_id])
                .map_err(backend)?;
            match failure.action {
                FailureAction::Retry { attempt, not_before } => {
                    cached_execute(tx,
                        "UPDATE tasks SET state = 'ready', attempt = ?2, not_before_ms = ?3,
                         lease_owner = NULL, lease_expires_ms = NULL, output_recorded = 0
                         WHERE task_id = ?1",
                        params![failure.task_id, attempt, not_before],
                    )
                    .map_err(backend)?;
                }
                FailureAction::Redeliver => {
                    // The same attempt again only while it provably produced
                    // nothing: checked in this statement, so that a "started"
                    // write committed after the reaper looked wins, and the
                    // whole failure (history included) is rolled back.
                    let redelivered = cached_execute(tx,
                        "UPDATE tasks SET state = 'ready', lease_owner = NULL, lease_expires_ms = NULL
                         WHERE task_id = ?1 AND output_recorded = 0",
                        params![failure.task_id],
                    )
                    .map_err(backend)?;
                    if redelivered == 0 {
                        return Err(StoreError::OutputRecorded { task_id: failure.task_id });
                    }
                }
                FailureAction::GiveUp { route, flow_error } => {
                    cached_execute(tx, "DELETE FROM tasks WHERE task_id = ?1", params![failure.task_id])
                        .map_err(backend)?;
                    let flow_type: String = cached_query_row(tx,
                            "SELECT flow_type FROM flows WHERE flow_id = ?1",
                            params![failure.flow_id],
                            |row| row.get(0),
                        )
                        .map_err(backend)?;
                    match route {
                        Some(route) => {
                            state::insert_task(tx, &failure.flow_id, &flow_type, &route)?;
                        }
                        None => {
                            cached_execute(tx,
                                "UPDATE flows SET status = 'failed', error = ?2, updated_at_ms = ?3
                                 WHERE flow_id = ?1",
                                params![failure.flow_id, flow_error, now],
                            )
                            .map_err(backend)?;
                            state::drop_tasks(tx, &failure.flow_id)?;
                        }
                    }
                }
            }
            Ok(())
        })
        .await
    }

    async fn expired_leases(
        &self,
        flow_types: &[String],
        limit: usize,
    ) -> Result<Vec<ExpiredLease>, StoreError> {
        if flow_types.is_empty() {
            return Ok(Vec::new());
        }
        let flow_types = flow_types.to_vec();
        self.read(move |conn, now| state::expired_leases(conn, now, &flow_types, limit))
            .await
    }

    async fn next_due(&self, flow_types: &[String]) -> Result<Option<StoreMillis>, StoreError> {
        if flow_types.is_empty() {
            return Ok(None);
        }
        let flow_types = flow_types.to_vec();
        self.read(move |conn, _| {
            let list = in_list(flow_types.len());
            let sql = format!(
                "SELECT MIN(due) FROM (
                   SELECT MIN(not_before_ms) AS due FROM tasks WHERE state = 'ready' AND flow_type IN ({list})
                   UNION ALL
                   SELECT MIN(wake_at_ms) FROM tasks WHERE state = 'waiting' AND flow_type IN ({list})
                   UNION ALL
                   SELECT MIN(lease_expires_ms) FROM tasks WHERE state = 'leased' AND flow_type IN ({list}))"
            );
            let params: Vec<&String> = flow_types.iter().chain(&flow_types).chain(&flow_types).collect();
            cached_query_row(conn, &sql, rusqlite::params_from_iter(params), |row| row.get(0))
                .map_err(backend)
        })
        .await
    }

    async fn get(
        &self,
        flow_id: &str,
        name: &str,
        key: &str,
    ) -> Result<Option<Versioned>, StoreError> {
        let (flow_id, name, key) = (flow_id.to_string(), name.to_string(), key.to_string());
        self.read(move |conn, _| state::get(conn, &flow_id, &name, &key))
            .await
    }

    async fn read_map(
        &self,
        flow_id: &str,
        name: &str,
        query: MapQuery,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        let (flow_id, name) = (flow_id.to_string(), name.to_string());
        self.read(move |conn, _| state::read_map(conn, &flow_id, &name, &query))
            .await
    }

    async fn channel_len(
        &self,
        flow_id: &str,
        channel: &str,
        key: &str,
    ) -> Result<u64, StoreError> {
        let (flow_id, channel, key) = (flow_id.to_string(), channel.to_string(), key.to_string());
        self.read(move |conn, _| state::channel_len(conn, &flow_id, &channel, &key))
            .await
    }

    async fn record_output_and_append(
        &self,
        task_id: i64,
        lease_token: i64,
        flow_id: &str,
        stream: &str,
        payloads: Vec<Json>,
    ) -> Result<(), StoreError> {
        let (flow_id, stream) = (flow_id.to_string(), stream.to_string());
        self.write_quietly(move |tx, now| {
            state::record_output(tx, now, task_id, lease_token)?;
            streams::append_fitting(tx, now, &flow_id, &stream, &payloads)?;
            Ok(())
        })
        .await
    }

    async fn read_state(
        &self,
        flow_id: &str,
        queries: Vec<StateQuery>,
    ) -> Result<Vec<StateAnswer>, StoreError> {
        let flow_id = flow_id.to_string();
        // Off the runtime: RunModel reads a turn's whole history here.
        self.read_blocking(move |conn, _| {
            // One transaction, so that every answer comes from one snapshot.
            let tx = conn.unchecked_transaction().map_err(backend)?;
            let answers = queries
                .iter()
                .map(|query| match query {
                    StateQuery::Get { name, key } => {
                        state::get(&tx, &flow_id, name, key).map(StateAnswer::Value)
                    }
                    StateQuery::Map { name, query } => {
                        state::read_map(&tx, &flow_id, name, query).map(StateAnswer::Entries)
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            tx.finish().map_err(backend)?;
            Ok(answers)
        })
        .await
    }

    async fn append_stream(
        &self,
        flow_id: &str,
        stream: &str,
        payloads: Vec<Json>,
    ) -> Result<Vec<i64>, StoreError> {
        let (flow_id, stream) = (flow_id.to_string(), stream.to_string());
        self.write_quietly(move |tx, now| {
            streams::append_stream(tx, now, &flow_id, &stream, &payloads)
        })
        .await
    }

    async fn read_stream(
        &self,
        flow_id: &str,
        stream: &str,
        after_seq: i64,
        limit: usize,
    ) -> Result<StreamPage, StoreError> {
        let (flow_id, stream) = (flow_id.to_string(), stream.to_string());
        self.read(move |conn, _| streams::read_stream(conn, &flow_id, &stream, after_seq, limit))
            .await
    }

    async fn set_stream_capacity(
        &self,
        flow_id: &str,
        stream: &str,
        capacity_bytes: u64,
    ) -> Result<(), StoreError> {
        let (flow_id, stream) = (flow_id.to_string(), stream.to_string());
        self.write_quietly(move |tx, _| {
            streams::set_stream_capacity(tx, &flow_id, &stream, capacity_bytes)
        })
        .await
    }

    async fn step_history(&self, flow_id: &str) -> Result<Vec<StepHistoryEntry>, StoreError> {
        let flow_id = flow_id.to_string();
        self.read(move |conn, _| {
            let mut stmt = conn
                .prepare(
                    "SELECT event_type, step_type, step_execution_id, attempt, at_ms, detail, started_at_ms, component
                     FROM step_history WHERE flow_id = ?1 ORDER BY entry_id",
                )
                .map_err(backend)?;
            let rows = stmt
                .query_map(params![flow_id], |row| {
                    Ok(StepHistoryEntry {
                        event_type: row.get(0)?,
                        step_type: row.get(1)?,
                        step_execution_id: row.get(2)?,
                        final_attempt: row.get(3)?,
                        at: row.get(4)?,
                        detail: row.get(5)?,
                        started_at: row.get(6)?,
                        component: row.get(7)?,
                    })
                })
                .map_err(backend)?
                .collect::<Result<Vec<_>, _>>()
                .map_err(backend);
            rows
        })
        .await
    }

    async fn rpc(&self, flow_id: &str, body: RpcBody) -> Result<Box<dyn Any + Send>, RpcError> {
        let flow_id = flow_id.to_string();
        self.write_job(true, move |conn, now| {
            let mut state = SqliteStateTx::new(conn, flow_id, now);
            body(&mut state)
        })
        .await
    }

    /// On a read connection, off the runtime, in one deferred transaction:
    /// WAL gives it a snapshot of the last commit, and it never waits for the
    /// writer nor makes the writer wait.
    async fn read_rpc(
        &self,
        flow_id: &str,
        body: RpcBody,
    ) -> Result<Box<dyn Any + Send>, RpcError> {
        let flow_id = flow_id.to_string();
        self.read_blocking(move |conn, now| {
            let tx = conn.unchecked_transaction().map_err(backend)?;
            let result = {
                let mut state = SqliteStateTx::read_only(&tx, flow_id, now);
                body(&mut state)
            };
            // Nothing was written: ending the transaction only releases the
            // snapshot (a rollback, the default).
            tx.finish().map_err(backend)?;
            result
        })
        .await
    }
}

/// Whether a row exists (helper for `OptionalExtension` queries).
pub(crate) fn exists(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<bool, StoreError> {
    cached_query_row(conn, sql, params, |_| Ok(()))
        .optional()
        .map(|found| found.is_some())
        .map_err(backend)
}
