//! The client side: start and stop flows, run RPCs, read state.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::registry::{Registry, RegistryError};
use super::store::{FlowStore, RpcError, StateTx, StoreError};
use super::types::{FlowInfo, Json, StepCall, StepHistoryEntry, StreamPage};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum FlowError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Rpc(#[from] RpcError),
}

/// How long an RPC is retried while it meets lock conflicts.
pub const RPC_LOCK_RETRY: Duration = Duration::from_secs(5);

/// Starts flows, runs RPCs and reads state.
#[derive(Clone)]
pub struct FlowClient {
    store: Arc<dyn FlowStore>,
    registry: Arc<Registry>,
}

impl FlowClient {
    pub fn new(store: Arc<dyn FlowStore>, registry: Arc<Registry>) -> Self {
        Self { store, registry }
    }

    pub fn store(&self) -> &Arc<dyn FlowStore> {
        &self.store
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Starts `flow_id` at its flow type's start Step.
    pub async fn start_flow(
        &self,
        flow_type: &str,
        flow_id: &str,
        input: Json,
    ) -> Result<(), FlowError> {
        let start = self.registry.flow_type(flow_type)?.start_step.clone();
        let now = self.store.now().await?;
        let first = self
            .registry
            .new_task(flow_type, StepCall::new(start, input), now, None)?;
        self.store.create_flow(flow_id, flow_type, first).await?;
        Ok(())
    }

    pub async fn flow(&self, flow_id: &str) -> Result<Option<FlowInfo>, FlowError> {
        Ok(self.store.flow(flow_id).await?)
    }

    pub async fn stop_flow(&self, flow_id: &str) -> Result<bool, FlowError> {
        Ok(self.store.stop_flow(flow_id).await?)
    }

    pub async fn step_history(&self, flow_id: &str) -> Result<Vec<StepHistoryEntry>, FlowError> {
        Ok(self.store.step_history(flow_id).await?)
    }

    pub async fn read_stream(
        &self,
        flow_id: &str,
        stream: &str,
        after_seq: i64,
        limit: usize,
    ) -> Result<StreamPage, FlowError> {
        Ok(self
            .store
            .read_stream(flow_id, stream, after_seq, limit)
            .await?)
    }

    /// Runs `body` in one transaction, once; a lock conflict is returned.
    pub async fn rpc_once<T, F>(&self, flow_id: &str, body: F) -> Result<T, RpcError>
    where
        T: Send + 'static,
        F: FnOnce(&mut dyn StateTx) -> Result<T, RpcError> + Send + 'static,
    {
        self.rpc_once_as(false, flow_id, body).await
    }

    /// [`Self::rpc_once`], run with [`FlowStore::rpc_small`] when `small`.
    async fn rpc_once_as<T, F>(&self, small: bool, flow_id: &str, body: F) -> Result<T, RpcError>
    where
        T: Send + 'static,
        F: FnOnce(&mut dyn StateTx) -> Result<T, RpcError> + Send + 'static,
    {
        let body: super::store::RpcBody =
            Box::new(move |tx| body(tx).map(|v| Box::new(v) as Box<dyn std::any::Any + Send>));
        let value = if small {
            self.store.rpc_small(flow_id, body).await?
        } else {
            self.store.rpc(flow_id, body).await?
        };
        value
            .downcast::<T>()
            .map(|v| *v)
            .map_err(|_| RpcError::Store(StoreError::Backend("rpc returned another type".into())))
    }

    /// Runs `body` in one read-only transaction: one consistent snapshot,
    /// served without the store's writer (see [`FlowStore::read_rpc`]).
    /// Every write in `body` fails; a read never meets a lock conflict.
    pub async fn read_rpc<T, F>(&self, flow_id: &str, body: F) -> Result<T, RpcError>
    where
        T: Send + 'static,
        F: FnOnce(&mut dyn StateTx) -> Result<T, RpcError> + Send + 'static,
    {
        let value = self
            .store
            .read_rpc(
                flow_id,
                Box::new(move |tx| body(tx).map(|v| Box::new(v) as Box<dyn std::any::Any + Send>)),
            )
            .await?;
        value.downcast::<T>().map(|v| *v).map_err(|_| {
            RpcError::Store(StoreError::Backend("read_rpc returned another type".into()))
        })
    }

    /// Runs `body` in one transaction, retrying lock conflicts for up to
    /// [`RPC_LOCK_RETRY`].
    pub async fn rpc<T, F>(&self, flow_id: &str, body: F) -> Result<T, RpcError>
    where
        T: Send + 'static,
        F: Fn(&mut dyn StateTx) -> Result<T, RpcError> + Send + Sync + 'static,
    {
        self.rpc_as(false, flow_id, body).await
    }

    /// [`Self::rpc`] for a body its caller knows to be small: a few rows and
    /// a few KiB (see [`FlowStore::rpc_small`]).
    pub async fn rpc_small<T, F>(&self, flow_id: &str, body: F) -> Result<T, RpcError>
    where
        T: Send + 'static,
        F: Fn(&mut dyn StateTx) -> Result<T, RpcError> + Send + Sync + 'static,
    {
        self.rpc_as(true, flow_id, body).await
    }

    async fn rpc_as<T, F>(&self, small: bool, flow_id: &str, body: F) -> Result<T, RpcError>
    where
        T: Send + 'static,
        F: Fn(&mut dyn StateTx) -> Result<T, RpcError> + Send + Sync + 'static,
    {
        let body = Arc::new(body);
        let started = Instant::now();
        let mut pause = Duration::from_millis(5);
        loop {
            let attempt = body.clone();
            match self
                .rpc_once_as(small, flow_id, move |tx| attempt(tx))
                .await
            {
                Err(RpcError::LockConflict { .. }) if started.elapsed() < RPC_LOCK_RETRY => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                other => return other,
            }
        }
    }
}
