//! The state an RPC works on, over a PostgreSQL transaction.
//!
//! An RPC body is synchronous (it is written once for every backend), so it
//! runs on a blocking thread, and each of its reads and writes drives the
//! async client to completion there with the runtime's handle.

use std::future::Future;

use deadpool_postgres::Transaction;
use tokio::runtime::Handle;

use super::sql::{query_opt, TxResult};
use crate::flow::store::{RpcError, StateTx, StoreError};
use crate::flow::types::{FlowInfo, Json, MapQuery, StoreMillis, Versioned};

/// One flow's state inside one transaction; for a read-only RPC, every
/// write is refused.
pub(super) struct PgStateTx<'a, 't> {
    tx: &'a Transaction<'t>,
    handle: Handle,
    flow_id: String,
    now: StoreMillis,
    read_only: bool,
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
}
