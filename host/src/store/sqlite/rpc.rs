//! RPC transactions on SQLite: [`SqliteStateTx`], the [`StateTx`] an RPC's
//! body works on, in the writer's transaction or in a read transaction.

use std::any::Any;

use rusqlite::{params, Connection};

use super::flows::flow_info;
use super::sql::{backend, exists};
use super::{state, streams, tasks};
use crate::flow::store::{RpcBody, RpcError, StateTx, StoreError};
use crate::flow::types::{FlowInfo, Json, MapQuery, NewTask, StoreMillis, TakenTask, Versioned};

/// What an RPC's commit must wake, after it.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RpcWakes {
    /// It appended to the flow's streams: their readers.
    pub appended: bool,
    /// It took the flow's tasks: the Steps running them.
    pub took: bool,
}

/// Runs `body` on `flow_id` in the writer's transaction `conn`; says too
/// what the caller wakes after the commit.
pub(super) fn run(
    conn: &Connection,
    flow_id: String,
    now: StoreMillis,
    body: RpcBody,
) -> Result<(Box<dyn Any + Send>, RpcWakes), RpcError> {
    let mut state = SqliteStateTx::new(conn, flow_id, now);
    let value = body(&mut state)?;
    Ok((value, state.wakes))
}

/// Runs `body` on `flow_id` on the read connection `conn`, in one deferred
/// transaction: WAL gives it a snapshot of the last commit, and it never
/// waits for the writer nor makes the writer wait.
pub(super) fn run_read_only(
    conn: &Connection,
    flow_id: String,
    now: StoreMillis,
    body: RpcBody,
) -> Result<Box<dyn Any + Send>, RpcError> {
    // The error type is RpcError, which takes a StoreError, not a rusqlite
    // error: hence `backend` rather than `?` alone.
    let tx = conn.unchecked_transaction().map_err(backend)?;
    let result = {
        let mut state = SqliteStateTx::read_only(&tx, flow_id, now);
        body(&mut state)
    };
    // Nothing was written: ending the transaction only releases the
    // snapshot (a rollback, the default).
    tx.finish().map_err(backend)?;
    result
}

/// The state an RPC works on: one flow, inside one write transaction, or,
/// for a read-only RPC, one read transaction on a read connection, where
/// every write is refused instead of going through a connection that is not
/// the writer.
pub(super) struct SqliteStateTx<'c> {
    conn: &'c Connection,
    flow_id: String,
    now: StoreMillis,
    read_only: bool,
    wakes: RpcWakes,
}

impl<'c> SqliteStateTx<'c> {
    pub(super) fn new(conn: &'c Connection, flow_id: String, now: StoreMillis) -> Self {
        Self {
            conn,
            flow_id,
            now,
            read_only: false,
            wakes: RpcWakes::default(),
        }
    }

    pub(super) fn read_only(conn: &'c Connection, flow_id: String, now: StoreMillis) -> Self {
        Self {
            read_only: true,
            ..Self::new(conn, flow_id, now)
        }
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

impl StateTx for SqliteStateTx<'_> {
    fn now(&self) -> StoreMillis {
        self.now
    }

    fn flow(&mut self) -> Result<Option<FlowInfo>, StoreError> {
        flow_info(self.conn, &self.flow_id)
    }

    fn get(&mut self, name: &str, key: &str) -> Result<Option<Versioned>, StoreError> {
        state::get(self.conn, &self.flow_id, name, key)
    }

    fn set(&mut self, name: &str, key: &str, value: Json) -> Result<i64, StoreError> {
        self.writable(&format!("set {name}"))?;
        state::set(self.conn, &self.flow_id, name, key, &value)
    }

    fn delete(&mut self, name: &str, key: &str) -> Result<(), StoreError> {
        self.writable(&format!("delete {name}"))?;
        state::delete(self.conn, &self.flow_id, name, key)
    }

    fn lock(&mut self, name: &str) -> Result<(), RpcError> {
        if self.read_only {
            return Err(RpcError::Rejected(format!(
                "lock {name} on flow {} in a read-only transaction",
                self.flow_id
            )));
        }
        let held = exists(
            self.conn,
            "SELECT 1 FROM state_locks l JOIN tasks t ON t.task_id = l.task_id
             WHERE l.flow_id = ?1 AND l.name = ?2 AND t.state = 'leased' AND t.lease_expires_ms > ?3",
            params![self.flow_id, name, self.now],
        )?;
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
        state::publish(self.conn, self.now, &self.flow_id, channel, key, &payload)
    }

    fn channel_len(&mut self, channel: &str, key: &str) -> Result<u64, StoreError> {
        state::channel_len(self.conn, &self.flow_id, channel, key)
    }

    fn read_map(
        &mut self,
        name: &str,
        query: &MapQuery,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        state::read_map(self.conn, &self.flow_id, name, query)
    }

    fn take_tasks(&mut self) -> Result<Vec<TakenTask>, StoreError> {
        self.writable("take the tasks")?;
        let taken = tasks::flow_tasks(self.conn, &self.flow_id)?;
        tasks::drop_tasks(self.conn, &self.flow_id)?;
        tasks::count_revocation(self.conn, &self.flow_id)?;
        self.wakes.took = true;
        Ok(taken)
    }

    fn add_task(&mut self, task: NewTask) -> Result<(), StoreError> {
        self.writable(&format!("add task {}", task.step_type))?;
        let flow = flow_info(self.conn, &self.flow_id)?.ok_or_else(|| StoreError::NoSuchFlow {
            flow_id: self.flow_id.clone(),
        })?;
        tasks::insert_task(self.conn, &self.flow_id, &flow.flow_type, &task)?;
        Ok(())
    }

    fn append(&mut self, stream: &str, payload: Json) -> Result<i64, StoreError> {
        self.writable(&format!("append to {stream}"))?;
        let seqs = streams::append_stream(self.conn, self.now, &self.flow_id, stream, &[payload])?;
        self.wakes.appended = true;
        seqs.first().copied().ok_or_else(|| {
            StoreError::Backend(format!("the append to {stream} returned no sequence"))
        })
    }
}
