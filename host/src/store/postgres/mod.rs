//! The PostgreSQL backend: many processes on many machines share one
//! database.
//!
//! - Each operation is one transaction on a pooled connection
//!   (`deadpool-postgres`), with statements prepared once per connection.
//!   A transaction that loses a deadlock runs again (`sql::retrying`).
//! - Workers claim with `FOR UPDATE SKIP LOCKED`; the writes of one flow
//!   apply one at a time under its row's lock (`tasks.rs` says why).
//! - Commits that may make work ready `NOTIFY`; each process `LISTEN`s on
//!   one connection of its own and wakes its workers (`listen.rs`).
//! - The store's clock is the database's (`listen::DbClock`).
//!
//! This file implements the traits and writes no SQL; each table family
//! has its file, as on SQLite.

mod catalog;
mod flows;
mod history;
mod listen;
mod load;
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
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::Notify;

use crate::flow::store::{
    AttemptFailure, ExpiredLease, FailureAction, FlowStore, RpcBody, RpcError, StateAnswer,
    StateQuery, StepCommit, StoreError,
};
use crate::flow::types::{
    ClaimedTask, FlowInfo, Json, MapQuery, NewTask, StateWrite, StepHistoryEntry, StoreMillis,
    StreamPage, Versioned,
};
use sql::{execute, retrying, TxError, TxResult};

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
    /// Connects, creates the schema in an empty database and checks the
    /// version of an existing one: a newer one is refused, and so is an
    /// older one until `dexa store migrate` has run.
    pub async fn connect(url: PostgresUrl) -> Result<Self, StoreError> {
        let pool = pool(&url)?;
        {
            let mut client = pool.get().await.map_err(|err| {
                StoreError::Backend(format!("cannot connect to {}: {err}", url.text))
            })?;
            if let Some(schema) = &url.schema {
                client
                    .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                    .await?;
            }
            if let schema::SchemaState::Older(found) = schema::open(&mut client).await? {
                return Err(StoreError::Backend(format!(
                    "the PostgreSQL store has schema {found} and this dexa writes schema {}; \
                     run `dexa store migrate` first",
                    schema::SCHEMA_VERSION
                )));
            }
        }
        let schema = url.schema.as_deref().unwrap_or("public");
        let signals = Arc::new(Signals::new(
            format!("dexa_work_{schema}"),
            format!("dexa_events_{schema}"),
        ));
        let (clock, listener) = listen::start(url.clone(), signals.clone()).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                url,
                pool,
                signals,
                clock,
                listener,
            }),
        })
    }

    /// Applies the schema's migrations; returns the versions before and
    /// after.
    pub async fn migrate(url: &PostgresUrl) -> Result<(i64, i64), StoreError> {
        let pool = pool(url)?;
        let mut client = pool.get().await?;
        if let Some(schema) = &url.schema {
            client
                .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await?;
        }
        schema::migrate(&mut client).await
    }

    /// Drops this store's schema with everything in it (for benchmarks
    /// and tests that made one of their own); refused for a store in the
    /// default schema.
    pub async fn drop_schema(&self) -> Result<(), StoreError> {
        let Some(schema) = &self.inner.url.schema else {
            return Err(StoreError::Backend(
                "this store has no schema of its own to drop".to_string(),
            ));
        };
        let client = self.client().await?;
        client
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await?;
        Ok(())
    }

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
        execute(
            tx,
            "SELECT pg_notify($1, '')",
            &[&self.inner.signals.work_channel],
        )
        .await?;
        Ok(())
    }

    /// Wakes the readers of `flow_id`'s streams in every process at commit.
    async fn notify_stream<C: deadpool_postgres::GenericClient>(
        &self,
        tx: &C,
        flow_id: &str,
    ) -> TxResult<()> {
        execute(
            tx,
            "SELECT pg_notify($1, $2)",
            &[&self.inner.signals.events_channel, &flow_id],
        )
        .await?;
        Ok(())
    }

    /// Wakes this process's workers now (the notification comes back too,
    /// but later).
    fn wake_here(&self) {
        self.inner.signals.work.notify_waiters();
    }
}

fn pool(url: &PostgresUrl) -> Result<Pool, StoreError> {
    let tls = url.tls().map_err(StoreError::Backend)?;
    let manager = Manager::from_config(
        url.config.clone(),
        tls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(url.pool_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(10)))
        .create_timeout(Some(Duration::from_secs(5)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .build()
        .map_err(|err| StoreError::Backend(format!("the PostgreSQL pool: {err}")))
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
        Some(self.inner.signals.stream(flow_id))
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

    async fn list_flows(
        &self,
        flow_type: Option<&str>,
        limit: usize,
    ) -> Result<Vec<FlowInfo>, StoreError> {
        on_client!(self, |client, now| {
            flows::list_flows(&client, flow_type, limit).await?
        })
    }

    async fn stop_flow(&self, flow_id: &str) -> Result<bool, StoreError> {
        in_tx!(self, false, |tx, now| {
            flows::stop_flow(&tx, now, flow_id).await?
        })
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
            tasks::any_claimable(&client, now, flow_types).await?
        })?;
        if !any {
            return Ok(Vec::new());
        }
        in_tx!(self, false, |tx, now| {
            tasks::claim(
                &tx,
                now,
                worker_id,
                tasks::ClaimScope::FlowTypes(flow_types),
                max,
                lease_ms,
            )
            .await?
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
            tasks::renew_leases(&client, now, worker_id, held, lease_ms).await?
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
        self.inner.signals.wake_stream(flow_id);
        Ok(())
    }

    async fn commit_step(&self, commit: StepCommit) -> Result<Vec<ClaimedTask>, StoreError> {
        let commit = &commit;
        let appends = commit
            .writes
            .iter()
            .any(|write| matches!(write, StateWrite::Append { .. }));
        let claimed = in_tx!(self, true, |tx, now| {
            tasks::lock_flow(&tx, &commit.flow_id).await?;
            tasks::commit_step(&tx, now, commit).await?;
            if appends {
                self.notify_stream(&tx, &commit.flow_id).await?;
            }
            match &commit.claim_next {
                Some(next) if next.max > 0 => {
                    tasks::claim(
                        &tx,
                        now,
                        &next.worker_id,
                        tasks::ClaimScope::Flow(&commit.flow_id),
                        next.max,
                        next.lease_ms,
                    )
                    .await?
                }
                _ => Vec::new(),
            }
        })?;
        if appends {
            self.inner.signals.wake_stream(&commit.flow_id);
        }
        Ok(claimed)
    }

    async fn fail_attempt(&self, failure: AttemptFailure) -> Result<(), StoreError> {
        let failure = &failure;
        in_tx!(self, true, |tx, now| {
            fail_attempt(&tx, now, failure).await?
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
            tasks::expired_leases(&client, now, flow_types, limit).await?
        })
    }

    async fn next_due(&self, flow_types: &[String]) -> Result<Option<StoreMillis>, StoreError> {
        if flow_types.is_empty() {
            return Ok(None);
        }
        on_client!(self, |client, now| {
            tasks::next_due(&client, flow_types).await?
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
        self.inner.signals.wake_stream(flow_id);
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

    async fn step_history(&self, flow_id: &str) -> Result<Vec<StepHistoryEntry>, StoreError> {
        on_client!(self, |client, now| {
            history::step_history(&client, flow_id).await?
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

impl PostgresStore {
    /// Runs an RPC body on a blocking thread in one transaction: a write
    /// RPC under the flow's lock, a read-only one in a repeatable-read
    /// snapshot. The body runs once (it is not retried).
    async fn run_rpc(
        &self,
        flow_id: String,
        body: RpcBody,
        read_only: bool,
    ) -> Result<Box<dyn Any + Send>, RpcError> {
        let store = self.clone();
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || -> Result<Box<dyn Any + Send>, RpcError> {
            let db = |err: tokio_postgres::Error| RpcError::Store(StoreError::from(err));
            let mut client = handle
                .block_on(store.client())
                .map_err(|err| RpcError::Store(StoreError::from(err)))?;
            let tx = if read_only {
                handle.block_on(
                    client
                        .build_transaction()
                        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                        .read_only(true)
                        .start(),
                )
            } else {
                handle.block_on(client.transaction())
            }
            .map_err(db)?;
            if !read_only {
                handle
                    .block_on(tasks::lock_flow_or_its_name(&tx, &flow_id))
                    .map_err(TxError::into_error)?;
            }
            let now = store.clock_now();
            let result = {
                let mut state = rpc::PgStateTx::new(&tx, handle.clone(), flow_id, now, read_only);
                body(&mut state)
            };
            match result {
                Ok(value) => {
                    if !read_only {
                        handle
                            .block_on(store.notify(&tx))
                            .map_err(TxError::into_error)?;
                    }
                    handle.block_on(tx.commit()).map_err(db)?;
                    Ok(value)
                }
                Err(err) => {
                    // Nothing of a refused RPC is kept.
                    let _ = handle.block_on(tx.rollback());
                    Err(err)
                }
            }
        })
        .await
        .map_err(|err| {
            RpcError::Store(StoreError::Backend(format!("an RPC did not finish: {err}")))
        })?
    }
}

/// A failed attempt: history, locks released, then retry, redeliver or
/// give up (the SQLite backend documents each case).
async fn fail_attempt<C: deadpool_postgres::GenericClient>(
    tx: &C,
    now: StoreMillis,
    failure: &AttemptFailure,
) -> TxResult<()> {
    tasks::lock_flow(tx, &failure.flow_id).await?;
    tasks::check_lease(
        tx,
        failure.task_id,
        failure.lease_token,
        failure.require_expired.then_some(now),
    )
    .await?;
    history::insert_history(tx, &failure.flow_id, &failure.history).await?;
    tasks::release_locks(tx, failure.task_id).await?;
    match &failure.action {
        FailureAction::Retry {
            attempt,
            not_before,
        } => tasks::retry(tx, failure.task_id, *attempt, *not_before).await,
        FailureAction::Redeliver => tasks::redeliver(tx, failure.task_id).await,
        FailureAction::GiveUp { route, flow_error } => {
            let flow_type = tasks::remove(tx, failure.task_id).await?;
            match route {
                Some(route) => {
                    tasks::insert_task(tx, &failure.flow_id, &flow_type, route).await?;
                    Ok(())
                }
                None => flows::fail_flow(tx, now, &failure.flow_id, flow_error).await,
            }
        }
    }
}
