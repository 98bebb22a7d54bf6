//! AgentSessionFlow: the spec's durable agent session on the Flow engine, with
//! a sandboxed runner component and tool components.
//!
//! - [`AgentSessionFlow`]: one flow type per agent; [`AgentSessionFlow::definition`]
//!   is what a worker's registry runs.
//! - [`AgentSessionClient`]: the RPCs (start, send, resolve, snapshot, list, stop).
//! - [`records`]: the stored records and the wire values.
//!
//! Every Step commits its state, channel messages, events and next Steps in
//! one transaction (the spec's SYNC durability; the engine has no other kind).

mod cancel;
mod client;
mod components;
pub mod event_data;
mod events;
mod flow;
mod history;
mod import;
pub mod limits;
mod options;
pub mod policy;
pub mod records;
mod steps;
mod versions;
mod wait;

pub use cancel::CancelOutcome;
pub use client::{new_session_id, AgentSessionClient, SessionError};
pub use components::{AgentComponents, AgentConfigError, VersionError};
pub use events::BACKGROUND_HEARTBEAT;
pub use flow::{
    AgentSessionFlow, RUN_MODEL_HEARTBEAT_TIMEOUT, RUN_MODEL_TIMEOUT, RUN_MODEL_WINDOW,
};
pub use history::{check_compaction, AgentCompaction};
pub use import::{
    ImportedMessage, IMPORTED_TURN_ID, MAX_IMPORTED_MESSAGES, MAX_IMPORTED_MESSAGE_BYTES,
    MAX_IMPORT_BYTES,
};
pub use limits::TurnLimits;
pub use options::AgentSessionOptions;
pub use policy::{ToolPolicies, ToolPolicyOverride};
pub use records::*;
pub use steps::{
    check_tool_calls_requested, step, turn_cancelled_note, turn_failure_note, CancelTurnInput,
    TakenStep,
};
pub use versions::{ActivationWatch, CatalogVersions, ComponentLoader};
pub use wait::{TurnWait, MAX_TURN_WAIT};
