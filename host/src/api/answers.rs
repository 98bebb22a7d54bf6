//! The bodies the API answers with, as types. Each handler returns one of
//! these (or a session type it serializes as is), and the OpenAPI
//! document's schemas are derived from the same types, so the document
//! says what the handlers send: a field that is always sent is `required`,
//! one that is sent only sometimes says when.

use schemars::JsonSchema;
use serde::Serialize;

use crate::catalog::{ActivationEntry, ComponentRecord};
use crate::flow::{FlowInfo, FlowStatus, StepHistoryEntry, StoreMillis};
use crate::session::{AgentInterrupt, AgentMessage, AgentUsage, TurnWait};

/// `GET /v1/agents`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct AgentList {
    pub agents: Vec<AgentInfo>,
}

/// One agent this server runs.
#[derive(Debug, Serialize, JsonSchema)]
pub struct AgentInfo {
    pub name: String,
    /// Its runner component's name in `dexa.toml`.
    pub runner: String,
    /// Its tool components' names.
    pub tool_components: Vec<String>,
    /// Its model's name in `dexa.toml`, if it names one.
    pub model: Option<String>,
}

/// `POST /v1/agents/{agent}/sessions`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct SessionStarted {
    pub agent: String,
    pub session_id: String,
}

/// `GET /v1/sessions`: one page, newest first.
#[derive(Debug, Serialize, JsonSchema)]
pub struct SessionList {
    pub sessions: Vec<SessionSummary>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// One session of a listing.
#[derive(Debug, Serialize, JsonSchema)]
pub struct SessionSummary {
    pub session_id: String,
    pub agent: String,
    pub status: FlowStatus,
    /// ms since the epoch, on the store's clock.
    pub created_at: StoreMillis,
    /// ms since the epoch, on the store's clock.
    pub updated_at: StoreMillis,
    /// Why the session failed, when it did.
    pub error: Option<String>,
}

impl From<FlowInfo> for SessionSummary {
    fn from(flow: FlowInfo) -> Self {
        Self {
            session_id: flow.flow_id,
            agent: flow.flow_type,
            status: flow.status,
            created_at: flow.created_at,
            updated_at: flow.updated_at,
            error: flow.error,
        }
    }
}

/// `POST /v1/sessions/{id}/messages`: the message was queued (or, for a
/// retried key, was queued before); with `wait`, how its turn went.
#[derive(Debug, Default, Serialize, JsonSchema)]
#[schemars(rename = "Queued")]
pub struct SendAnswer {
    /// Always true: the message is queued (or was, for a replay).
    pub queued: bool,
    /// The queued message's id (a replay's is the first send's); the
    /// `turn_started` event of its turn carries it.
    pub message_id: Option<String>,
    /// Only with an Idempotency-Key: the key.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub idempotency_key: Option<String>,
    /// Only with an Idempotency-Key: true when a message with this key was
    /// queued before and nothing was queued now.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "bool")]
    pub replayed: Option<bool>,
    /// Only with `interrupt`: the turn it cancelled, null when none ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub interrupted: Option<Option<String>>,
    /// Only with `wait`: how the wait ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "WaitStatus")]
    pub status: Option<WaitStatus>,
    /// Only with `wait`: the message's turn; null while it is still queued
    /// (or when it was given up before its turn ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub turn_id: Option<Option<String>>,
    /// Only when completed: the messages the turn added after the user's.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Vec<AgentMessage>")]
    pub messages: Option<Vec<AgentMessage>>,
    /// Only when completed: what the turn's model calls used.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "AgentUsage")]
    pub usage: Option<AgentUsage>,
    /// Only when failed: why.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub error: Option<String>,
    /// Only when waiting_for_approval: the turn's pending approvals.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Vec<AgentInterrupt>")]
    pub interrupts: Option<Vec<AgentInterrupt>>,
    /// Only when session_ended: the session's status (`stopped`, or
    /// `failed` or `completed` for a session that ended so).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub session_status: Option<String>,
}

/// How a send's wait ended (`session_ended`: the session was stopped before
/// the turn ended, which it never will now).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WaitStatus {
    Completed,
    Failed,
    Cancelled,
    WaitingForApproval,
    SessionEnded,
    Running,
}

impl SendAnswer {
    /// Adds how the wait for the message's turn ended.
    pub fn waited(mut self, waited: TurnWait) -> Self {
        let (status, turn_id) = match waited {
            TurnWait::Completed {
                turn_id,
                messages,
                usage,
            } => {
                self.messages = Some(messages);
                self.usage = Some(usage);
                (WaitStatus::Completed, Some(turn_id))
            }
            TurnWait::Failed { turn_id, error } => {
                self.error = Some(error);
                (WaitStatus::Failed, turn_id)
            }
            TurnWait::Cancelled { turn_id } => (WaitStatus::Cancelled, Some(turn_id)),
            TurnWait::WaitingForApproval {
                turn_id,
                interrupts,
            } => {
                self.interrupts = Some(interrupts);
                (WaitStatus::WaitingForApproval, Some(turn_id))
            }
            TurnWait::SessionEnded {
                turn_id,
                session_status,
            } => {
                self.session_status = Some(session_status);
                (WaitStatus::SessionEnded, turn_id)
            }
            TurnWait::Running { turn_id } => (WaitStatus::Running, turn_id),
        };
        self.status = Some(status);
        self.turn_id = Some(turn_id);
        self
    }
}

/// `POST /v1/sessions/{id}/turn/cancel`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TurnCancel {
    /// False when no turn was running.
    pub cancelled: bool,
    /// Only when cancelled: the turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub turn_id: Option<String>,
    /// Only when `?turn_id=` named a turn that is not the one running: the
    /// one that is (left running).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub running_turn_id: Option<String>,
}

/// `POST /v1/sessions/{id}/interrupts`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Resolved {
    /// Whether it was pending and is now resolved.
    pub resolved: bool,
}

/// `POST /v1/sessions/{id}/stop`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Stopped {
    /// Whether it was running.
    pub stopped: bool,
}

/// `GET /v1/sessions/{id}/history`: one page of the Step history.
#[derive(Debug, Serialize, JsonSchema)]
pub struct StepHistory {
    pub steps: Vec<StepHistoryEntry>,
    /// Pass as `after` for the next page; null on the last page.
    pub next_after: Option<i64>,
}

/// `GET /v1/components`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ComponentList {
    pub components: Vec<ComponentRecord>,
}

/// `POST /v1/components`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ComponentAdded {
    pub component: ComponentRecord,
    /// False when it was in the catalog already.
    pub added: bool,
}

/// `POST /v1/agents/{agent}/activations` and `.../rollback`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Activated {
    pub activation: ActivationEntry,
}

/// The last event of an ended session's stream.
#[derive(Debug, Serialize, JsonSchema)]
pub struct SessionEnded {
    pub session_id: String,
    pub status: FlowStatus,
    /// Why the session failed, when it did.
    pub error: Option<String>,
}
