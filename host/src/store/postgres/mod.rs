//! The PostgreSQL backend: many processes on many machines share one
//! database.
//!
//! - Each operation is one transaction on a pooled connection
//!   (`deadpool-postgres`), with statements prepared once per connection.
//!   A transaction that loses a deadlock runs again (`sql::retrying`).
//! - Workers claim with `FOR UPDATE SKIP LOCKED` (`claims.rs`); the writes
//!   of one flow apply one at a time under its row's lock (`tasks.rs` says
//!   why).
//! - Commits that make work ready for others `NOTIFY`, and stream appends
//!   name their flow; each process `LISTEN`s on one connection of its own
//!   and wakes its workers and that flow's event readers (`listen.rs`).
//! - The store's clock is the database's (`listen::DbClock`).
//!
//! This file implements the traits and writes no SQL: opening is in
//! `connect.rs`, RPCs in `rpc.rs`, each table family has its file as on
//! SQLite (`flows`, `tasks`, `claims`, `state`, `streams`, `history`,
//! `catalog`), and `load.rs` is the target side of `dexa store copy`.

mod catalog;
mod claims;
mod commit;
mod connect;
mod flows;
mod history;
mod listen;
mod load;
mod queue;
mod rpc;
pub mod schema;
mod sql;
mod state;
mod streams;
mod tasks;
pub mod url;

pub use listen::{DbClock, Signals};
pub use url::PostgresUrl;

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use deadpool_postgres::Pool;
use tokio::sync::Notify;

use crate::flow::store::{
    AttemptFailure, ExpiredLease, FlowStore, RpcBody, RpcError, StateAnswer, StateQuery,
    StepCommit, StoreError,
};
use crate::flow::types::{
    ClaimedTask, FlowCursor, FlowInfo, Json, MapQuery, NewTask, StateWrite, StepHistoryEntry,
    StoreMillis, StreamPage, TaskCounts, Versioned,
};
use sql::{retrying, TxResult};

/// The PostgreSQL store. Cheap to clone.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    url: PostgresUrl,
    pool: Pool,
    /// The `NOTIFY` channels of this store (per schema) and who they wake.
    signals: Arc<Signals>,
    clock: Arc<DbClock>,
    listener: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl PostgresStore {
    /// The address, as written (it holds no password).
    pub fn url(&self) -> &str {
        &self.inner.url.text
    }

    /// The database's time now.
    fn clock_now(&self) -> StoreMillis {
        self.inner.clock.now()
    }

    async fn client(&self) -> Result<deadpool_postgres::Client, deadpool_postgres::PoolError> {
        self.inner.pool.get().await
    }

    /// Wakes the workers of every process at commit.
    async fn notify<C: deadpool_postgres::GenericClient>(&self, tx: &C) -> TxResult<()> {
        listen::notify(tx, &self.inner.signals.work_channel, "").await
    }

    /// Wakes the readers of `flow_id`'s streams in every process at commit.
    async fn notify_stream<C: deadpool_postgres::GenericClient>(
        &self,
        tx: &C,
        flow_id: &str,
    ) -> TxResult<()> {
        listen::notify(tx, &self.inner.signals.events_channel, flow_id).await
    }

    /// Wakes the Steps running for `flow_id` in every process at commit:
    /// its tasks were taken.
    async fn notify_revoked<C: deadpool_postgres::GenericClient>(
        &self,
        tx: &C,
        flow_id: &str,
    ) -> TxResult<()> {
        listen::notify(tx, &self.inner.signals.revoke_channel, flow_id).await
    }

    /// Wakes this process's workers now (the notification comes back too,
    /// but later).
    fn wake_here(&self) {
        self.inner.signals.work.notify_waiters();
    }
}

/// Runs `$body` in a transaction (with `tx` and `now` bound), retried on a
/// deadlock; `$wake` says whether the commit may make work ready.
macro_rules! in_tx {
    ($store:expr, $wake:expr, |$tx:ident, $now:ident| $body:expr) => {{
        let store = $store;
        let result = retrying(|| async move {
            let mut client = store.client().await?;
            let $tx = client.transaction().await?;
            let $now = store.clock_now();
            let value = $body;
            if $wake {
                store.notify(&$tx).await?;
            }
            $tx.commit().await?;
            Ok(value)
        })
        .await;
        if $wake && result.is_ok() {
            store.wake_here();
        }
        result
    }};
}

/// Runs `$body` on a pooled connection outside a transaction.
macro_rules! on_client {
    ($store:expr, |$client:ident, $now:ident| $body:expr) => {{
        let store = $store;
        retrying(|| async move {
            let $client = store.client().await?;
            let $now = store.clock_now();
            let _ = $now;
            Ok($body)
        })
        .await
    }};
}

#[async_trait]
impl FlowStore for PostgresStore {
    async fn now(&self) -> Result<StoreMillis, StoreError> {
        Ok(self.clock_now())
    }

    fn work_signal(&self) -> Arc<Notify> {
        self.inner.signals.work.clone()
    }

    fn stream_signal(&self, flow_id: &str) -> Option<Arc<Notify>> {
        Some(self.inner.signals.streams.stream(flow_id))
    }

    fn stream_stops(&self, flow_id: &str) -> u64 {
        self.inner.signals.streams.stops(flow_id)
    }

    fn revocation_signal(&self, flow_id: &str) -> Option<Arc<Notify>> {
        Some(self.inner.signals.revocations.stream(flow_id))
    }

    fn revocation_generation(&self) -> u64 {
        self.inner.signals.revocations.generation()
    }

    async fn create_flow(
        &self,
        flow_id: &str,
        flow_type: &str,
        first: NewTask,
    ) -> Result<(), StoreError> {
        let first = &first;
        in_tx!(self, true, |tx, now| {
            flows::create_flow(&tx, now, flow_id, flow_type, first).await?
        })
    }

    async fn flow(&self, flow_id: &str) -> Result<Option<FlowInfo>, StoreError> {
        on_client!(self, |client, now| flows::flow_info(&client, flow_id)
            .await?)
    }

    async fn task_counts(&self) -> Result<TaskCounts, StoreError> {
        in_tx!(self, false, |tx, now| {
            let _ = now;
            queue::task_counts(&tx).await?
        })
    }

    async fn list_flows(
        &self,
        flow_type: Option<&str>,
        after: Option<&FlowCursor>,
        limit: usize,
    ) -> Result<Vec<FlowInfo>, StoreError> {
        on_client!(self, |client, now| {
            flows::list_flows(&client, flow_type, after, limit).await?
        })
    }

    async fn stop_flow(&self, flow_id: &str) -> Result<bool, StoreError> {
        let stopped = in_tx!(self, false, |tx, now| {
            let stopped = flows::stop_flow(&tx, now, flow_id).await?;
            if stopped {
                self.notify_revoked(&tx, flow_id).await?;
            }
            stopped
        })?;
        if stopped {
            self.inner.signals.revocations.wake(flow_id);
            // Its event streams and waiters end (a stop appends nothing).
            self.inner.signals.streams.wake_stopped(flow_id);
        }
        Ok(stopped)
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
        // Most looks find nothing; a read says so without a transaction.
        let any = on_client!(self, |client, now| {
            claims::any_claimable(&client, now, flow_types).await?
        })?;
        if !any {
            return Ok(Vec::new());
        }
        in_tx!(self, false, |tx, now| {
            claims::claim(&tx, now, worker_id, flow_types, max, lease_ms).await?
        })
    }

    async fn renew_leases(
        &self,
        worker_id: &str,
        held: &[(i64, i64)],
        lease_ms: i64,
    ) -> Result<Vec<(i64, i64)>, StoreError> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        on_client!(self, |client, now| {
            claims::renew_leases(&client, now, worker_id, held, lease_ms).await?
        })
    }

    async fn lease_held(&self, task_id: i64, lease_token: i64) -> Result<bool, StoreError> {
        on_client!(self, |client, now| {
            tasks::lease_held(&client, task_id, lease_token).await?
        })
    }

    async fn record_output(&self, task_id: i64, lease_token: i64) -> Result<(), StoreError> {
        on_client!(self, |client, now| {
            tasks::record_output(&client, now, task_id, lease_token).await?
        })
    }

    async fn record_output_and_append(
        &self,
        task_id: i64,
        lease_token: i64,
        flow_id: &str,
        stream: &str,
        payloads: Vec<Json>,
    ) -> Result<(), StoreError> {
        let payloads = &payloads;
        in_tx!(self, false, |tx, now| {
            // The stream's row before the task's, the order of commits.
            streams::append_fitting(&tx, now, flow_id, stream, payloads).await?;
            tasks::record_output(&tx, now, task_id, lease_token).await?;
            self.notify_stream(&tx, flow_id).await?;
        })?;
        self.inner.signals.streams.wake(flow_id);
        Ok(())
    }

    async fn commit_step(&self, commit: StepCommit) -> Result<Vec<ClaimedTask>, StoreError> {
        let commit = &commit;
        let appends = commit
            .writes
            .iter()
            .any(|write| matches!(write, StateWrite::Append { .. }));
        // A publish can make waiting tasks ready.
        let publishes = commit
            .writes
            .iter()
            .any(|write| matches!(write, StateWrite::Publish { .. }));
        let (claimed, woke) = in_tx!(self, false, |tx, now| {
            let commit::Committed { inserted, claimed } =
                commit::commit_step(&tx, now, commit).await?;
            if appends {
                self.notify_stream(&tx, &commit.flow_id).await?;
            }
            // Workers elsewhere are woken only when this commit leaves them
            // something: a sequential flow's next Step, leased with the
            // commit, costs no NOTIFY (whose commit-time lock every
            // notifying transaction of the database shares) and wakes no
            // one. Any other new task (ready, waiting on a timer, or on
            // messages already there) wakes them, as does a publish.
            let woke = publishes
                || inserted
                    .iter()
                    .any(|id| !claimed.iter().any(|task| task.task_id == *id));
            if woke {
                self.notify(&tx).await?;
            }
            (claimed, woke)
        })?;
        if woke {
            self.wake_here();
        }
        if appends {
            self.inner.signals.streams.wake(&commit.flow_id);
        }
        Ok(claimed)
    }

    async fn fail_attempt(&self, failure: AttemptFailure) -> Result<(), StoreError> {
        let failure = &failure;
        in_tx!(self, true, |tx, now| {
            tasks::fail_attempt(&tx, now, failure).await?
        })
    }

    async fn expired_leases(
        &self,
        flow_types: &[String],
        limit: usize,
    ) -> Result<Vec<ExpiredLease>, StoreError> {
        if flow_types.is_empty() {
            return Ok(Vec::new());
        }
        on_client!(self, |client, now| {
            claims::expired_leases(&client, now, flow_types, limit).await?
        })
    }

    async fn next_due(&self, flow_types: &[String]) -> Result<Option<StoreMillis>, StoreError> {
        if flow_types.is_empty() {
            return Ok(None);
        }
        on_client!(self, |client, now| {
            claims::next_due(&client, flow_types).await?
        })
    }

    async fn get(
        &self,
        flow_id: &str,
        name: &str,
        key: &str,
    ) -> Result<Option<Versioned>, StoreError> {
        on_client!(self, |client, now| {
            state::get(&client, flow_id, name, key).await?
        })
    }

    async fn read_map(
        &self,
        flow_id: &str,
        name: &str,
        query: MapQuery,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        let query = &query;
        on_client!(self, |client, now| {
            state::read_map(&client, flow_id, name, query).await?
        })
    }

    async fn read_state(
        &self,
        flow_id: &str,
        queries: Vec<StateQuery>,
    ) -> Result<Vec<StateAnswer>, StoreError> {
        let queries = &queries;
        // One repeatable-read transaction: every answer from one snapshot.
        retrying(|| async move {
            let mut client = self.client().await?;
            let tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await?;
            let mut answers = Vec::with_capacity(queries.len());
            for query in queries {
                answers.push(match query {
                    StateQuery::Get { name, key } => {
                        StateAnswer::Value(state::get(&tx, flow_id, name, key).await?)
                    }
                    StateQuery::Map { name, query } => {
                        StateAnswer::Entries(state::read_map(&tx, flow_id, name, query).await?)
                    }
                });
            }
            tx.commit().await?;
            Ok(answers)
        })
        .await
    }

    async fn channel_len(
        &self,
        flow_id: &str,
        channel: &str,
        key: &str,
    ) -> Result<u64, StoreError> {
        on_client!(self, |client, now| {
            state::channel_len(&client, flow_id, channel, key).await?
        })
    }

    async fn append_stream(
        &self,
        flow_id: &str,
        stream: &str,
        payloads: Vec<Json>,
    ) -> Result<Vec<i64>, StoreError> {
        let payloads = &payloads;
        let seqs = in_tx!(self, false, |tx, now| {
            let seqs = streams::append_stream(&tx, now, flow_id, stream, payloads).await?;
            self.notify_stream(&tx, flow_id).await?;
            seqs
        })?;
        self.inner.signals.streams.wake(flow_id);
        Ok(seqs)
    }

    async fn read_stream(
        &self,
        flow_id: &str,
        stream: &str,
        after_seq: i64,
        limit: usize,
    ) -> Result<StreamPage, StoreError> {
        retrying(|| async move {
            let mut client = self.client().await?;
            let tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await?;
            let page = streams::read_stream(&tx, flow_id, stream, after_seq, limit).await?;
            tx.commit().await?;
            Ok(page)
        })
        .await
    }

    async fn set_stream_capacity(
        &self,
        flow_id: &str,
        stream: &str,
        capacity_bytes: u64,
    ) -> Result<(), StoreError> {
        in_tx!(self, false, |tx, now| {
            let _ = now;
            streams::set_stream_capacity(&tx, flow_id, stream, capacity_bytes).await?
        })
    }

    async fn step_history_page(
        &self,
        flow_id: &str,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<(i64, StepHistoryEntry)>, StoreError> {
        on_client!(self, |client, now| {
            history::step_history(&client, flow_id, after, limit).await?
        })
    }

    async fn rpc(&self, flow_id: &str, body: RpcBody) -> Result<Box<dyn Any + Send>, RpcError> {
        let result = self.run_rpc(flow_id.to_string(), body, false).await;
        if result.is_ok() {
            self.wake_here();
        }
        result
    }

    async fn read_rpc(
        &self,
        flow_id: &str,
        body: RpcBody,
    ) -> Result<Box<dyn Any + Send>, RpcError> {
        self.run_rpc(flow_id.to_string(), body, true).await
    }
}
