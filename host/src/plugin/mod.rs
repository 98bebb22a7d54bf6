//! The wasmtime layer: the engine, the compiled-artifact cache, loading runner
//! and tool components, and calling them, each call in a fresh sandbox.
//!
//! - [`SandboxEngine`]: one per process; pooling allocator, epoch deadlines.
//! - [`RunnerComponent`] and [`ToolComponent`]: a loaded component with one
//!   `InstancePre`; every call gets a new `Store` and instance.
//! - [`factors`]: the host capabilities behind the WIT imports, one module each.
//! - [`Grants`] and [`ComponentLimits`]: what a component may reach and use.
//! - `guest_pool`: long calls move to lower-priority threads.
//! - `boundary`: the byte caps on what a guest returns.
//! - [`guest_log`]: the guest's stdout and stderr, kept up to a cap.
//! - [`tool_schema`]: the check of each tool's parameter schema at load.

pub mod bindings;
mod boundary;
pub mod cache;
mod call;
mod component;
pub mod engine;
pub mod error;
pub mod factors;
pub mod grant_paths;
pub mod grants;
pub mod guest_log;
mod guest_pool;
mod limits;
pub mod tool_schema;
mod wit_version;

pub use bindings::wit;
pub use cache::{
    CacheOutcome, DEFAULT_MAX_BYTES as DEFAULT_CACHE_MAX_BYTES,
    MIN_MAX_BYTES as MIN_CACHE_MAX_BYTES,
};
pub use call::{CallEnv, CallState};
pub use component::{ComponentInfo, ComponentSettings, RunnerComponent, ToolComponent, World};
pub use engine::{SandboxConfig, SandboxEngine};
pub use error::{CallError, LoadError};
pub use factors::events::{EventSink, EventWriter, GuestEvent, TaggedEvent, EVENT_ENVELOPE_BYTES};
pub use factors::history::{HistorySource, MemoryHistory, TurnInput};
pub use factors::model::ModelProvider;
pub use factors::policy::{NoPolicies, ToolPolicyResolver};
pub use factors::step::{HeartbeatSink, StepTag};
pub use grants::{DirAccess, DirGrant, Grants, HttpAuthority};
pub use limits::ComponentLimits;
pub use wit_version::{WIT_PACKAGE, WIT_VERSION};
