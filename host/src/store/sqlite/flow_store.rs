//! [`FlowStore`] on SQLite: each operation as a read on a pooled connection
//! or a write on the writer, calling the table modules beside it.

use std::any::Any;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Notify;

use super::small::CommitSize;
use super::sql::now_millis;
use super::{
    claims, flows, history, queue, rpc, small, state, streams, tasks, SqliteStore, WriteKind,
};
use crate::flow::store::{
    AttemptFailure, ExpiredLease, FlowStore, RpcBody, RpcError, StateAnswer, StateQuery,
    StepCommit, StoreError,
};
use crate::flow::types::{
    ClaimedTask, FlowCursor, FlowInfo, Json, MapQuery, NewTask, StateWrite, StepHistoryEntry,
    StoreMillis, StreamPage, TaskCounts, Versioned,
};

#[async_trait]
impl FlowStore for SqliteStore {
    async fn now(&self) -> Result<StoreMillis, StoreError> {
        Ok(now_millis())
    }

    fn work_signal(&self) -> Arc<Notify> {
        self.inner.signal.clone()
    }

    fn stream_signal(&self, flow_id: &str) -> Option<Arc<Notify>> {
        Some(self.inner.streams.stream(flow_id))
    }

    fn stream_stops(&self, flow_id: &str) -> u64 {
        self.inner.streams.stops(flow_id)
    }

    fn revocation_signal(&self, flow_id: &str) -> Option<Arc<Notify>> {
        Some(self.inner.revocations.stream(flow_id))
    }

    fn revocation_generation(&self) -> u64 {
        self.inner.revocations.generation()
    }

    async fn create_flow(
        &self,
        flow_id: &str,
        flow_type: &str,
        first: NewTask,
    ) -> Result<(), StoreError> {
        let (flow_id, flow_type) = (flow_id.to_string(), flow_type.to_string());
        self.write(move |tx, now| flows::create_flow(tx, now, flow_id, &flow_type, &first))
            .await
    }

    async fn flow(&self, flow_id: &str) -> Result<Option<FlowInfo>, StoreError> {
        let flow_id = flow_id.to_string();
        self.read(move |conn, _| flows::flow_info(conn, &flow_id))
            .await
    }

    async fn task_counts(&self) -> Result<TaskCounts, StoreError> {
        // A scan of every task: off the runtime's threads.
        self.read_blocking(move |conn, _| queue::task_counts(conn))
            .await
    }

    async fn list_flows(
        &self,
        flow_type: Option<&str>,
        after: Option<&FlowCursor>,
        limit: usize,
    ) -> Result<Vec<FlowInfo>, StoreError> {
        let flow_type = flow_type.map(str::to_string);
        let after = after.cloned();
        self.read(move |conn, _| {
            flows::list_flows(conn, flow_type.as_deref(), after.as_ref(), limit)
        })
        .await
    }

    async fn stop_flow(&self, flow_id: &str) -> Result<bool, StoreError> {
        let flow = flow_id.to_string();
        let stopped = self
            .write(move |tx, now| flows::stop_flow(tx, now, &flow))
            .await?;
        if stopped {
            self.inner.revocations.wake(flow_id);
            // Its event streams and waiters end (a stop appends nothing).
            self.inner.streams.wake_stopped(flow_id);
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
        // Most looks find nothing; a read says so without taking the writer.
        // A task made ready after this read wakes the worker again.
        let probe = flow_types.to_vec();
        if !self
            .read(move |conn, now| claims::any_claimable(conn, now, &probe))
            .await?
        {
            return Ok(Vec::new());
        }
        let worker_id = worker_id.to_string();
        let flow_types = flow_types.to_vec();
        // Small: a few tasks' rows, read by index, like the inline reads.
        self.write_as(WriteKind::QUIET.small_if(true), move |tx, now| {
            claims::claim(
                tx,
                now,
                &worker_id,
                claims::ClaimScope::FlowTypes(&flow_types),
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
        let small = held.len() <= small::MAX_ROWS;
        self.write_as(WriteKind::QUIET.small_if(small), move |tx, now| {
            tasks::renew_leases(tx, now, &worker_id, held, lease_ms)
        })
        .await
    }

    async fn lease_held(&self, task_id: i64, lease_token: i64) -> Result<bool, StoreError> {
        self.read(move |conn, _| tasks::lease_held(conn, task_id, lease_token))
            .await
    }

    async fn record_output(&self, task_id: i64, lease_token: i64) -> Result<(), StoreError> {
        self.write_as(WriteKind::QUIET.small_if(true), move |tx, now| {
            tasks::record_output(tx, now, task_id, lease_token)
        })
        .await
    }

    async fn commit_step(&self, commit: StepCommit) -> Result<Vec<ClaimedTask>, StoreError> {
        let appends = commit
            .writes
            .iter()
            .any(|write| matches!(write, StateWrite::Append { .. }));
        let flow_id = commit.flow_id.clone();
        let small = match small::commit_size(&commit) {
            CommitSize::Small => true,
            CommitSize::Large => false,
            // An inline read of at most `rows` keys plus one a map, only when the
            // write could run here at all: two thread hops cost more. A
            // read that fails leaves the write to the writer thread, which
            // reports its own failure if it has one.
            CommitSize::SmallIfCleared { maps, rows, bytes }
                if self.inner.writer.may_run_here() =>
            {
                let flow_id = commit.flow_id.clone();
                self.read(move |conn, _| state::maps_fit(conn, &flow_id, &maps, rows, bytes))
                    .await
                    .unwrap_or_else(|err| {
                        tracing::debug!(error = %err, "cannot size the maps a commit clears; it queues");
                        false
                    })
            }
            CommitSize::SmallIfCleared { .. } => false,
        };
        let kind = WriteKind::WAKES.small_if(small);
        let (claimed, head) = self
            .write_as(kind, move |tx, now| {
                let claim_next = commit.claim_next.clone();
                let flow_id = commit.flow_id.clone();
                tasks::commit_step(tx, now, commit)?;
                let head = appends
                    .then(|| streams::flow_head(tx, &flow_id))
                    .transpose()?;
                let claimed = match claim_next {
                    Some(next) if next.max > 0 => claims::claim(
                        tx,
                        now,
                        &next.worker_id,
                        claims::ClaimScope::Flow(&flow_id),
                        next.max,
                        next.lease_ms,
                    )?,
                    _ => Vec::new(),
                };
                Ok((claimed, head))
            })
            .await?;
        if let Some(head) = head {
            self.inner.streams.wake_committed(&flow_id, head);
        }
        Ok(claimed)
    }

    async fn fail_attempt(&self, failure: AttemptFailure) -> Result<(), StoreError> {
        self.write(move |tx, now| tasks::fail_attempt(tx, now, failure))
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
        self.read(move |conn, now| tasks::expired_leases(conn, now, &flow_types, limit))
            .await
    }

    async fn next_due(&self, flow_types: &[String]) -> Result<Option<StoreMillis>, StoreError> {
        if flow_types.is_empty() {
            return Ok(None);
        }
        let flow_types = flow_types.to_vec();
        self.read(move |conn, _| tasks::next_due(conn, &flow_types))
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
        let (flow, stream) = (flow_id.to_string(), stream.to_string());
        let kind = WriteKind::QUIET.small_if(small::small_payloads(&payloads));
        let head = self
            .write_as(kind, move |tx, now| {
                tasks::record_output(tx, now, task_id, lease_token)?;
                streams::append_fitting(tx, now, &flow, &stream, &payloads)?;
                streams::flow_head(tx, &flow)
            })
            .await?;
        self.inner.streams.wake_committed(flow_id, head);
        Ok(())
    }

    async fn read_state(
        &self,
        flow_id: &str,
        queries: Vec<StateQuery>,
    ) -> Result<Vec<StateAnswer>, StoreError> {
        let flow_id = flow_id.to_string();
        // Off the runtime: RunModel reads a turn's whole history here.
        self.read_blocking(move |conn, _| state::read_state(conn, &flow_id, &queries))
            .await
    }

    async fn append_stream(
        &self,
        flow_id: &str,
        stream: &str,
        payloads: Vec<Json>,
    ) -> Result<Vec<i64>, StoreError> {
        let (flow, stream) = (flow_id.to_string(), stream.to_string());
        let kind = WriteKind::QUIET.small_if(small::small_payloads(&payloads));
        let (seqs, head) = self
            .write_as(kind, move |tx, now| {
                let seqs = streams::append_stream(tx, now, &flow, &stream, &payloads)?;
                Ok((seqs, streams::flow_head(tx, &flow)?))
            })
            .await?;
        self.inner.streams.wake_committed(flow_id, head);
        Ok(seqs)
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

    async fn step_history_page(
        &self,
        flow_id: &str,
        after: Option<i64>,
        limit: usize,
    ) -> Result<Vec<(i64, StepHistoryEntry)>, StoreError> {
        let flow_id = flow_id.to_string();
        self.read(move |conn, _| history::step_history(conn, &flow_id, after, limit))
            .await
    }

    async fn rpc(&self, flow_id: &str, body: RpcBody) -> Result<Box<dyn Any + Send>, RpcError> {
        self.rpc_as(WriteKind::WAKES, flow_id, body).await
    }

    async fn rpc_small(
        &self,
        flow_id: &str,
        body: RpcBody,
    ) -> Result<Box<dyn Any + Send>, RpcError> {
        self.rpc_as(WriteKind::WAKES.small_if(true), flow_id, body)
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
        self.read_blocking(move |conn, now| rpc::run_read_only(conn, flow_id, now, body))
            .await
    }
}

impl SqliteStore {
    /// Runs an RPC as a write of `kind`, then wakes what its commit moved.
    async fn rpc_as(
        &self,
        kind: WriteKind,
        flow_id: &str,
        body: RpcBody,
    ) -> Result<Box<dyn Any + Send>, RpcError> {
        let flow = flow_id.to_string();
        let (value, wakes, head) = self
            .write_job(kind, move |conn, now| {
                let (value, wakes) = rpc::run(conn, flow.clone(), now, body)?;
                let head = if wakes.appended {
                    Some(streams::flow_head(conn, &flow)?)
                } else {
                    None
                };
                Ok::<_, RpcError>((value, wakes, head))
            })
            .await?;
        if let Some(head) = head {
            self.inner.streams.wake_committed(flow_id, head);
        }
        if wakes.took {
            self.inner.revocations.wake(flow_id);
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The thread an RPC's body ran on; the body writes a row, as a send
    /// does.
    async fn rpc_thread(store: &SqliteStore, small: bool) -> std::thread::ThreadId {
        let body: RpcBody = Box::new(|tx| {
            tx.set("sent", "", serde_json::json!(1))?;
            Ok(Box::new(std::thread::current().id()) as Box<dyn Any + Send>)
        });
        let ran = if small {
            store.rpc_small("f", body).await
        } else {
            store.rpc("f", body).await
        };
        match ran.map(|value| value.downcast::<std::thread::ThreadId>()) {
            Ok(Ok(thread)) => *thread,
            _ => panic!("the RPC did not answer with its thread"),
        }
    }

    /// A small RPC (a queued user message) to a quiet store runs on its
    /// caller's thread; any other RPC goes through the writer thread. Right
    /// after a commit the writer thread may still hold the connection for
    /// a moment (then a small RPC queues too), so the small one is tried a
    /// few times.
    #[test]
    fn a_small_rpc_to_a_quiet_store_runs_on_its_callers_thread() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open_normal_for_test(dir.path());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let here = std::thread::current().id();
        runtime.block_on(async {
            for _ in 0..3 {
                assert_ne!(rpc_thread(&store, false).await, here);
            }
            let mut here_once = false;
            for _ in 0..500 {
                tokio::time::sleep(Duration::from_millis(2)).await;
                if rpc_thread(&store, true).await == here {
                    here_once = true;
                    break;
                }
            }
            assert!(here_once, "no small RPC ran on its caller's thread");
            assert_ne!(rpc_thread(&store, false).await, here);
        });
    }
}
