//! The state an RPC works on, over a PostgreSQL transaction.
//!
//! An RPC body is synchronous (it is written once for every backend), so it
//! runs on a blocking thread, and each of its reads and writes drives the
//! async client to completion there with the runtime's handle.

use std::future::Future;

use deadpool_postgres::Transaction;
use tokio::runtime::Handle;

use super::sql::{query_opt, TxError, TxResult};
use super::PostgresStore;
use std::any::Any;

use crate::flow::store::{RpcBody, RpcError, StateTx, StoreError};
use crate::flow::types::{FlowInfo, Json, MapQuery, NewTask, StoreMillis, TakenTask, Versioned};

/// One flow's state inside one transaction; for a read-only RPC, every
/// write is refused.
pub(super) struct PgStateTx<'a, 't> {
    tx: &'a Transaction<'t>,
    handle: Handle,
    flow_id: String,
    now: StoreMillis,
    read_only: bool,
    /// Whether the body appended to a stream of the flow.
    appended: bool,
    /// Whether the body took the flow's tasks.
    took: bool,
}

impl<'a, 't> PgStateTx<'a, 't> {
    pub(super) fn new(
        tx: &'a Transaction<'t>,
        handle: Handle,
        flow_id: String,
        now: StoreMillis,
        read_only: bool,
    ) -> Self {
        Self {
            tx,
            handle,
            flow_id,
            now,
            read_only,
            appended: false,
            took: false,
        }
    }

    fn run<T>(&self, work: impl Future<Output = TxResult<T>>) -> Result<T, StoreError> {
        self.handle.block_on(work).map_err(|err| err.into_error())
    }

    /// Refuses `what` in a read-only transaction.
    fn writable(&self, what: &str) -> Result<(), StoreError> {
        if self.read_only {
            return Err(StoreError::Backend(format!(
                "{what} on flow {} in a read-only transaction",
                self.flow_id
            )));
        }
        Ok(())
    }
}

impl StateTx for PgStateTx<'_, '_> {
    fn now(&self) -> StoreMillis {
        self.now
    }

    fn flow(&mut self) -> Result<Option<FlowInfo>, StoreError> {
        self.run(super::flows::flow_info(self.tx, &self.flow_id))
    }

    fn get(&mut self, name: &str, key: &str) -> Result<Option<Versioned>, StoreError> {
        self.run(super::state::get(self.tx, &self.flow_id, name, key))
    }

    fn set(&mut self, name: &str, key: &str, value: Json) -> Result<i64, StoreError> {
        self.writable(&format!("set {name}"))?;
        self.run(super::state::set(self.tx, &self.flow_id, name, key, &value))
    }

    fn delete(&mut self, name: &str, key: &str) -> Result<(), StoreError> {
        self.writable(&format!("delete {name}"))?;
        self.run(super::state::delete(self.tx, &self.flow_id, name, key))
    }

    fn lock(&mut self, name: &str) -> Result<(), RpcError> {
        if self.read_only {
            return Err(RpcError::Rejected(format!(
                "lock {name} on flow {} in a read-only transaction",
                self.flow_id
            )));
        }
        let held = self.run(async {
            Ok(query_opt(
                self.tx,
                "SELECT 1 FROM state_locks l JOIN tasks t ON t.task_id = l.task_id
                 WHERE l.flow_id = $1 AND l.name = $2 AND t.state = 'leased'
                   AND t.lease_expires_ms > $3",
                &[&self.flow_id, &name, &self.now],
            )
            .await?
            .is_some())
        })?;
        if held {
            return Err(RpcError::LockConflict {
                flow_id: self.flow_id.clone(),
                name: name.to_string(),
            });
        }
        Ok(())
    }

    fn publish(&mut self, channel: &str, key: &str, payload: Json) -> Result<(), StoreError> {
        self.writable(&format!("publish to {channel}"))?;
        self.run(super::state::publish(
            self.tx,
            self.now,
            &self.flow_id,
            channel,
            key,
            &payload,
        ))
    }

    fn channel_len(&mut self, channel: &str, key: &str) -> Result<u64, StoreError> {
        self.run(super::state::channel_len(
            self.tx,
            &self.flow_id,
            channel,
            key,
        ))
    }

    fn read_map(
        &mut self,
        name: &str,
        query: &MapQuery,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        self.run(super::state::read_map(self.tx, &self.flow_id, name, query))
    }

    fn take_tasks(&mut self) -> Result<Vec<TakenTask>, StoreError> {
        self.writable("take the tasks")?;
        let taken = self.run(super::tasks::take_tasks(self.tx, &self.flow_id))?;
        self.took = true;
        Ok(taken)
    }

    fn add_task(&mut self, task: NewTask) -> Result<(), StoreError> {
        self.writable(&format!("add task {}", task.step_type))?;
        self.run(super::tasks::insert_task(self.tx, &self.flow_id, &task))?;
        Ok(())
    }

    fn append(&mut self, stream: &str, payload: Json) -> Result<i64, StoreError> {
        self.writable(&format!("append to {stream}"))?;
        let seqs = self.run(super::streams::append_stream(
            self.tx,
            self.now,
            &self.flow_id,
            stream,
            &[payload],
        ))?;
        self.appended = true;
        seqs.first().copied().ok_or_else(|| {
            StoreError::Backend(format!("the append to {stream} returned no sequence"))
        })
    }
}

impl PostgresStore {
    /// Runs an RPC body on a blocking thread in one transaction: a write
    /// RPC under the flow's lock, a read-only one in a repeatable-read
    /// snapshot. The body runs once (it is not retried).
    pub(super) async fn run_rpc(
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
                    .block_on(super::tasks::lock_flow_or_its_name(&tx, &flow_id))
                    .map_err(TxError::into_error)?;
            }
            let now = store.clock_now();
            let (result, appended, took) = {
                let mut state =
                    PgStateTx::new(&tx, handle.clone(), flow_id.clone(), now, read_only);
                let result = body(&mut state);
                (result, state.appended, state.took)
            };
            match result {
                Ok(value) => {
                    if !read_only {
                        handle
                            .block_on(store.notify(&tx))
                            .map_err(TxError::into_error)?;
                    }
                    if appended {
                        handle
                            .block_on(store.notify_stream(&tx, &flow_id))
                            .map_err(TxError::into_error)?;
                    }
                    if took {
                        handle
                            .block_on(store.notify_revoked(&tx, &flow_id))
                            .map_err(TxError::into_error)?;
                    }
                    handle.block_on(tx.commit()).map_err(db)?;
                    if appended {
                        store.inner.signals.streams.wake(&flow_id);
                    }
                    if took {
                        store.inner.signals.revocations.wake(&flow_id);
                    }
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
