//! The durable Flow engine. It knows nothing of agents: flows of Steps with
//! retries, timeouts and failure routes; leases with fencing tokens; state
//! (Attributes, maps, Channels, Timers, Streams); RPCs; step history. Every
//! Step's result commits in one transaction before it counts as done.
//!
//! Storage is behind [`store::FlowStore`]; backends live in `crate::store`.

mod attempt_span;
pub mod client;
pub mod context;
mod drain;
pub mod outage;
pub mod registry;
mod renew;
pub mod retry;
mod revoke;
mod run_step;
mod slots;
pub mod store;
mod supervise;
pub mod types;
pub mod worker;

pub use client::{FlowClient, FlowError, RPC_LOCK_RETRY};
pub use context::{Heartbeat, OnCommit, StepContext};
pub use outage::StoreHealth;
pub use registry::{FlowType, Registry, RegistryError, StepDef, StepError, StepHandler};
pub use store::{ClaimNext, FlowStore, RpcError, StateAnswer, StateQuery, StateTx, StoreError};
pub use types::*;
pub use worker::{Worker, WorkerOptions};
