//! The session's durable records and the values its RPCs and events carry.
//! The wire carries plain snake_case strings for every enum.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::flow::{FlowStatus, Json, StepContext, StoreMillis};
use crate::plugin::wit;
use crate::telemetry::traces::TurnTrace;

/// Attribute: the session's [`AgentState`].
pub const AGENT_STATE: &str = "AGENT_STATE";
/// AttributeMap: [`AgentMessage`] by [`message_sequence_key`].
pub const AGENT_MESSAGES: &str = "AGENT_MESSAGES";
/// Attribute: the runner's run state, set only while a turn waits for tools.
pub const FRAMEWORK_RUN_STATE: &str = "FRAMEWORK_RUN_STATE";
/// AttributeMap: [`AgentToolCall`] by tool call id, cleared when the turn ends.
pub const AGENT_TOOL_CALLS: &str = "AGENT_TOOL_CALLS";
/// AttributeMap: [`AgentInterrupt`] by interrupt id. The spec keeps a list in
/// one Attribute; one key per interrupt lets parallel approval Steps each
/// remove their own without overwriting the others.
pub const PENDING_INTERRUPTS: &str = "PENDING_INTERRUPTS";
/// AttributeMap: every interrupt the session raised, by interrupt id (the
/// value names its turn), kept after it is answered or expires: it tells an
/// unknown interrupt id from one that is no longer pending.
pub const RAISED_INTERRUPTS: &str = "RAISED_INTERRUPTS";
/// AttributeMap: [`AgentCompaction`] by [`message_sequence_key`] of the
/// sequence it summarizes through; the newest is the greatest key.
pub const AGENT_COMPACTIONS: &str = "AGENT_COMPACTIONS";
/// Attribute: the session's [`AgentUsage`].
pub const AGENT_USAGE: &str = "AGENT_USAGE";
/// Channel of [`AgentUserMessage`].
pub const QUEUED_USER_MESSAGES: &str = "QUEUED_USER_MESSAGES";
/// ChannelMap of [`AgentInterruptResolution`] by interrupt id.
pub const INTERRUPT_RESOLUTIONS: &str = "INTERRUPT_RESOLUTIONS";
/// Internal Channel of [`ToolCallCompleted`].
pub const TOOL_CALL_RESULTS: &str = "TOOL_CALL_RESULTS";
/// The turn a cancel was asked for and the steering messages waiting for
/// it, until its CancelTurn commits.
pub const CANCEL_REQUESTED: &str = "CANCEL_REQUESTED";
/// The most steering messages one pending cancel gathers; more is refused
/// (409 `busy`) until its CancelTurn has run.
pub const MAX_PENDING_STEERS: usize = 8;
/// Stream of [`AgentEvent`].
pub const AGENT_EVENTS: &str = "agent_events";

/// The AttributeMap key of message `sequence`: 12 digits, zero-padded, so that
/// key order is sequence order.
pub fn message_sequence_key(sequence: u64) -> String {
    format!("{sequence:012}")
}

/// The turn id of turn `n` (one-based).
pub fn turn_id(n: u64) -> String {
    format!("turn-{n}")
}

/// `<flow_id>/<turn_id>/<tool_call_id>`: the same on every attempt.
pub fn idempotency_key(flow_id: &str, turn_id: &str, tool_call_id: &str) -> String {
    format!("{flow_id}/{turn_id}/{tool_call_id}")
}

/// The interrupt that asks for approval of one tool call.
pub fn interrupt_id(turn_id: &str, tool_call_id: &str) -> String {
    format!("{turn_id}/{tool_call_id}")
}

/// What the session is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    WaitingForUserMessage,
    RunningModel,
    RunningTools,
}

/// The session's state Attribute.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentState {
    pub status: SessionStatus,
    /// Turns started so far; the active turn is `turn-<turn_count>`.
    pub turn_count: u64,
    /// The turn that is running, if any.
    pub active_turn_id: Option<String>,
    /// Messages stored so far; the next one gets `message_count + 1`.
    pub message_count: u64,
    /// Why the last failed turn failed; cleared when a later turn completes.
    pub last_turn_error: Option<String>,
    /// Only during a turn: the runner version (digest) it is pinned to;
    /// every Step of the turn runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub runner_digest: Option<String>,
    /// Only during a turn: its W3C trace (from its user message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "TurnTrace")]
    pub turn_trace: Option<TurnTrace>,
}

impl AgentState {
    pub(crate) fn new() -> Self {
        Self {
            status: SessionStatus::WaitingForUserMessage,
            turn_count: 0,
            active_turn_id: None,
            message_count: 0,
            last_turn_error: None,
            runner_digest: None,
            turn_trace: None,
        }
    }

    /// Ends the open turn's trace: its span is reported, with `outcome`,
    /// once `ctx`'s result commits.
    pub(crate) fn end_turn_trace(&mut self, ctx: &StepContext, turn: &str, outcome: &'static str) {
        if let Some(trace) = self.turn_trace.take() {
            let (session, turn) = (ctx.flow_id().to_string(), turn.to_string());
            ctx.on_commit(move || trace.report_end(&session, &turn, outcome));
        }
    }
}

/// Who a message is from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageRole {
    User,
    Assistant,
    Tool,
    System,
}

impl From<wit::MessageRole> for MessageRole {
    fn from(role: wit::MessageRole) -> Self {
        match role {
            wit::MessageRole::User => MessageRole::User,
            wit::MessageRole::Assistant => MessageRole::Assistant,
            wit::MessageRole::Tool => MessageRole::Tool,
            wit::MessageRole::System => MessageRole::System,
        }
    }
}

impl From<MessageRole> for wit::MessageRole {
    fn from(role: MessageRole) -> Self {
        match role {
            MessageRole::User => wit::MessageRole::User,
            MessageRole::Assistant => wit::MessageRole::Assistant,
            MessageRole::Tool => wit::MessageRole::Tool,
            MessageRole::System => wit::MessageRole::System,
        }
    }
}

/// A stored message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentMessage {
    /// Position in the session, from 1.
    #[schemars(range(min = 1))]
    pub sequence: u64,
    pub turn_id: String,
    pub role: MessageRole,
    /// The runner's own item, opaque to the host.
    pub framework_item: String,
    pub text: Option<String>,
}

impl AgentMessage {
    pub(crate) fn from_framework(
        sequence: u64,
        turn_id: &str,
        message: &wit::FrameworkMessage,
    ) -> Self {
        Self {
            sequence,
            turn_id: turn_id.to_string(),
            role: message.role.into(),
            framework_item: message.framework_item.clone(),
            text: message.text.clone(),
        }
    }

    pub(crate) fn to_wit(&self) -> wit::AgentMessage {
        wit::AgentMessage {
            sequence: self.sequence,
            turn_id: self.turn_id.clone(),
            role: self.role.into(),
            framework_item: self.framework_item.clone(),
            text: self.text.clone(),
        }
    }
}

/// What running a tool does to the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolEffect {
    Read,
    IdempotentWrite,
    NonIdempotentWrite,
    Unclassified,
}

impl ToolEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolEffect::Read => "read",
            ToolEffect::IdempotentWrite => "idempotent_write",
            ToolEffect::NonIdempotentWrite => "non_idempotent_write",
            ToolEffect::Unclassified => "unclassified",
        }
    }

    /// Read and idempotent-write calls may run again; the others run once.
    pub fn may_repeat(self) -> bool {
        matches!(self, ToolEffect::Read | ToolEffect::IdempotentWrite)
    }
}

impl From<wit::ToolEffect> for ToolEffect {
    fn from(effect: wit::ToolEffect) -> Self {
        match effect {
            wit::ToolEffect::Read => ToolEffect::Read,
            wit::ToolEffect::IdempotentWrite => ToolEffect::IdempotentWrite,
            wit::ToolEffect::NonIdempotentWrite => ToolEffect::NonIdempotentWrite,
            wit::ToolEffect::Unclassified => ToolEffect::Unclassified,
        }
    }
}

impl From<ToolEffect> for wit::ToolEffect {
    fn from(effect: ToolEffect) -> Self {
        match effect {
            ToolEffect::Read => wit::ToolEffect::Read,
            ToolEffect::IdempotentWrite => wit::ToolEffect::IdempotentWrite,
            ToolEffect::NonIdempotentWrite => wit::ToolEffect::NonIdempotentWrite,
            ToolEffect::Unclassified => wit::ToolEffect::Unclassified,
        }
    }
}

/// An operator's policy for one tool: its effect, and whether it needs
/// approval (`None`: the effect's default).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolPolicy {
    pub effect: ToolEffect,
    #[serde(default)]
    pub requires_approval: Option<bool>,
}

impl ToolPolicy {
    pub fn new(effect: ToolEffect) -> Self {
        Self {
            effect,
            requires_approval: None,
        }
    }

    pub fn requires_approval(mut self, required: bool) -> Self {
        self.requires_approval = Some(required);
        self
    }
}

/// Where a tool call stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallStatus {
    Pending,
    Approved,
    Succeeded,
    Failed,
    Rejected,
    OutcomeUnknown,
    // The turn was cancelled before the call finished (a call that may run
    // again, or one that never started). (A plain comment: a documented
    // variant would split the schema's enum.)
    Cancelled,
}

impl ToolCallStatus {
    /// The wire name; the one rendering the events factor uses too.
    pub fn as_str(self) -> &'static str {
        match self {
            ToolCallStatus::Cancelled => "cancelled",
            other => crate::plugin::factors::events::status_name(other.into()),
        }
    }

    pub fn is_final(self) -> bool {
        !matches!(self, ToolCallStatus::Pending | ToolCallStatus::Approved)
    }
}

impl From<ToolCallStatus> for wit::ToolCallStatus {
    fn from(status: ToolCallStatus) -> Self {
        match status {
            ToolCallStatus::Pending => wit::ToolCallStatus::Pending,
            ToolCallStatus::Approved => wit::ToolCallStatus::Approved,
            ToolCallStatus::Succeeded => wit::ToolCallStatus::Succeeded,
            ToolCallStatus::Failed => wit::ToolCallStatus::Failed,
            ToolCallStatus::Rejected => wit::ToolCallStatus::Rejected,
            ToolCallStatus::OutcomeUnknown => wit::ToolCallStatus::OutcomeUnknown,
            // The WIT has no cancelled status. A cancelled record ends its
            // turn (the records are cleared with it), so no runner is handed
            // one; were it, it reads as a failure, whose error says why.
            ToolCallStatus::Cancelled => wit::ToolCallStatus::Failed,
        }
    }
}

/// The durable record of one tool call of the active turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentToolCall {
    pub tool_call_id: String,
    pub turn_id: String,
    pub tool_name: String,
    pub arguments: String,
    pub effect: ToolEffect,
    pub requires_approval: bool,
    pub status: ToolCallStatus,
    pub output: Option<String>,
    pub error: Option<String>,
    pub rejection_message: Option<String>,
    /// Position in the model's response; AttributeMap keys do not keep order.
    pub deferral_order: u32,
    /// The most bytes of output (or error) this call may keep: its share of
    /// what the turn's tool-output budget had left when it was deferred.
    /// More is cut, with a marker that says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "u64")]
    pub output_limit: Option<u64>,
    /// The tool component that runs the call (its name in `dexa.toml`);
    /// absent when the runner runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub component: Option<String>,
    /// The version (digest) the call is pinned to, decided when it was
    /// deferred: every attempt and retry runs it, on any worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String")]
    pub digest: Option<String>,
}

impl AgentToolCall {
    pub fn to_wit(&self) -> wit::ToolCallRecord {
        wit::ToolCallRecord {
            tool_call_id: self.tool_call_id.clone(),
            tool_name: self.tool_name.clone(),
            arguments: self.arguments.clone(),
            policy: wit::ToolPolicy {
                effect: self.effect.into(),
                requires_approval: self.requires_approval,
            },
            status: self.status.into(),
            output: self.output.clone(),
            error: self.error.clone(),
            rejection_message: self.rejection_message.clone(),
            deferral_order: self.deferral_order,
        }
    }

    /// The model-visible text of this record's outcome.
    pub fn describe_outcome(&self) -> String {
        super::policy::describe_tool_call_outcome(&self.to_wit())
    }
}

/// A tool call waiting for a person's approval.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentInterrupt {
    pub interrupt_id: String,
    pub turn_id: String,
    pub tool_call_id: String,
    pub tool_name: String,
    /// The model's JSON text.
    pub arguments: String,
    /// When it expires (ms, on the store's clock); null waits forever.
    pub deadline: Option<StoreMillis>,
}

/// A person's answer to an interrupt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInterruptResolution {
    pub approved: bool,
    pub rejection_message: Option<String>,
}

/// Token usage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub total_tokens: u64,
    /// Model calls whose usage was recorded.
    pub model_calls: u64,
}

impl AgentUsage {
    pub(crate) fn of(usage: &wit::Usage) -> Self {
        Self {
            input_tokens: usage.input_tokens,
            output_tokens: usage.output_tokens,
            total_tokens: usage.total_tokens,
            model_calls: 1,
        }
    }

    pub(crate) fn add(&mut self, other: &AgentUsage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.total_tokens = self.total_tokens.saturating_add(other.total_tokens);
        self.model_calls = self.model_calls.saturating_add(other.model_calls);
    }
}

/// A user message, as `send_user_message` queues it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentUserMessage {
    pub text: String,
    /// How often the host queued it again because the runner never ran.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub requeued: u32,
    /// The id the send answered with; the `turn_started` (or `turn_failed`)
    /// event of the turn it starts carries it, so that a sender can wait
    /// for that turn. None for messages queued before ids were given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    /// The trace of the turn it starts (see [`crate::telemetry::traces`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TurnTrace>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Published once per tool call when its record becomes final.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallCompleted {
    pub tool_call_id: String,
    pub status: ToolCallStatus,
}

/// The input of StartAgentSession.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentSessionStartInput {
    #[serde(default)]
    pub initial_message: Option<String>,
    /// The trace of the turn the initial message starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_trace: Option<TurnTrace>,
}

/// `resolve_interrupt`'s request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(rename = "ResolveInterrupt")]
pub struct ResolveInterruptRequest {
    /// `<turn_id>/<tool_call_id>`, as `pending_interrupts` gives it.
    pub interrupt_id: String,
    pub approved: bool,
    /// What the model reads for a rejection; ignored for an approval.
    #[serde(default)]
    pub rejection_message: Option<String>,
}

/// Everything a UI needs to draw a session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentSnapshot {
    pub session_id: String,
    /// The session's agent.
    #[serde(default)]
    pub agent: String,
    pub flow_status: FlowStatus,
    /// Null until the session's first Step commits.
    pub state: Option<AgentState>,
    /// The last messages, oldest first.
    #[schemars(description = format!("The last {SNAPSHOT_MESSAGES} messages, oldest first"))]
    pub messages: Vec<AgentMessage>,
    pub pending_interrupts: Vec<AgentInterrupt>,
    /// The active turn's tool calls, in deferral order.
    pub tool_calls: Vec<AgentToolCall>,
    pub usage: AgentUsage,
    pub queued_message_count: u64,
}

/// Messages a snapshot carries.
pub const SNAPSHOT_MESSAGES: usize = 200;
/// The largest page `list_agent_messages` returns.
pub const MAX_MESSAGE_PAGE: u32 = 200;

/// `list_agent_messages`'s request: messages after `after_sequence`, oldest
/// first; `limit` is clamped to 1..=200.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListAgentMessagesRequest {
    #[serde(default)]
    pub after_sequence: Option<u64>,
    pub limit: u32,
}

/// A page of messages.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AgentMessagesPage {
    pub messages: Vec<AgentMessage>,
    /// Pass it as `after_sequence` for the next page; none when this page is
    /// the last.
    pub next_after_sequence: Option<u64>,
}

/// The event types of the session's stream.
pub mod event_type {
    pub const TURN_STARTED: &str = "turn_started";
    pub const TURN_COMPLETED: &str = "turn_completed";
    pub const TURN_FAILED: &str = "turn_failed";
    /// A client asked to cancel the running turn (the turn goes on until
    /// `turn_cancelled`).
    pub const TURN_CANCEL_REQUESTED: &str = "turn_cancel_requested";
    /// The turn was cancelled: its unfinished tool calls are recorded and a
    /// note is in the history.
    pub const TURN_CANCELLED: &str = "turn_cancelled";
    pub const TEXT_DELTA: &str = "text_delta";
    pub const REASONING_DELTA: &str = "reasoning_delta";
    pub const TOOL_CALL_STARTED: &str = "tool_call_started";
    pub const TOOL_CALL_FINISHED: &str = "tool_call_finished";
    pub const TOOL_CALL_DEFERRED: &str = "tool_call_deferred";
    pub const INTERRUPT_RAISED: &str = "interrupt_raised";
    pub const INTERRUPT_RESOLVED: &str = "interrupt_resolved";
    pub const USAGE_RECORDED: &str = "usage_recorded";
    /// A turn moved to another runner version (a forward fix).
    pub const VERSION_CHANGED: &str = "version_changed";
    /// The runner summarized the history through a sequence.
    pub const HISTORY_COMPACTED: &str = "history_compacted";
    /// What a guest printed to stdout or stderr in one call (kept up to a
    /// cap; `dropped_bytes` counts the rest).
    pub const GUEST_LOG: &str = "guest_log";
    /// Not a stored type: the name of the event stream's last event, once
    /// the session has ended. No guest event may take it.
    pub const SESSION_ENDED: &str = "session_ended";
}

/// One event of the session's stream. Every event carries the turn, the Step
/// execution (shared by its attempts) and the attempt. (The document's
/// event schemas are this envelope, with `type` and `data` by event type:
/// see [`super::event_data`].)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentEvent {
    #[serde(rename = "type")]
    pub event_type: String,
    pub turn_id: String,
    /// Shared by every attempt of one Step execution; empty on an event
    /// written outside a Step (`turn_cancel_requested`).
    pub step_execution_id: String,
    /// The Step attempt; 0 outside a Step.
    pub attempt: u32,
    /// Who wrote it: absent for the host's own record of what happened;
    /// `guest` for an event a component wrote during its call (a runner's
    /// or its model's deltas, a framework's tool events, custom events),
    /// which no client may take for the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "String", extend("enum" = [ORIGIN_GUEST]))]
    pub origin: Option<String>,
    pub data: Json,
}

/// The [`AgentEvent::origin`] of an event a component wrote.
pub const ORIGIN_GUEST: &str = "guest";

/// The largest user message, in bytes of UTF-8, that
/// [`send_user_message`](crate::session::AgentSessionClient::send_user_message)
/// and [`start_session`](crate::session::AgentSessionClient::start_session)
/// queue; a larger one is refused before anything is queued. The runner's
/// `build-user-message` returns the text twice (as the message's text and
/// inside its framework item, JSON-escaped at up to 6 bytes a byte), and
/// what it returns must fit the component's output cap (1 MiB by default):
/// 128 KiB stays under that cap whatever the text holds, so a message this
/// client accepts can always become a turn. A deployment that lowers a
/// runner's output cap lowers this too, with
/// [`with_max_user_message_bytes`](crate::session::AgentSessionClient::with_max_user_message_bytes).
pub const MAX_USER_MESSAGE_BYTES: usize = 128 << 10;

/// AttributeMap: [`IdempotencyRecord`] by idempotency key, for the user
/// messages queued with one. Kept in the session's own state and written in
/// the transaction that queues the message, so a retry is recognised by any
/// process, after any restart.
pub const IDEMPOTENCY_KEYS: &str = "IDEMPOTENCY_KEYS";
/// AttributeMap: the same keys (JSON strings) by
/// [`IdempotencyRecord::ordinal`], 12 digits zero-padded, so that key order
/// is age order: what pruning walks, oldest first.
pub const IDEMPOTENCY_KEY_ORDER: &str = "IDEMPOTENCY_KEY_ORDER";
/// The most idempotency keys a session remembers; recording one more
/// forgets the oldest.
pub const MAX_IDEMPOTENCY_KEYS: u64 = 1000;
/// How long a session remembers an idempotency key at least, unless
/// [`MAX_IDEMPOTENCY_KEYS`] newer keys push it out first: a client may retry
/// a send with its key for this long. Older keys are forgotten as new ones
/// are recorded.
pub const IDEMPOTENCY_KEY_RETENTION_MS: StoreMillis = 24 * 60 * 60 * 1000;
/// The longest idempotency key, in bytes. A key is 1 to this many printable
/// ASCII characters (`' '..='~'`), with no space at either end.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;

/// What a session remembers of a message queued with an idempotency key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyRecord {
    /// When the message was queued, on the store's clock.
    pub at: StoreMillis,
    /// The key's position among the session's keys, from 1; its key in
    /// [`IDEMPOTENCY_KEY_ORDER`].
    pub ordinal: u64,
    /// SHA-256 of the message's text, hex: a retry must carry the same text.
    pub text_sha256: String,
    /// The queued message's id, which a retry is answered with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    /// The session's newest event before the send, when the sender read it:
    /// a retry that waits for the message's turn looks for it after this,
    /// not from the oldest event kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_after: Option<i64>,
}

/// What a send did, with the queued message's id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sent {
    pub outcome: SendOutcome,
    /// The id of the message queued (for a replay, of the one the first
    /// send queued, if it has one); none for blank text.
    pub message_id: Option<String>,
    /// The turn a send with `interrupt` cancelled (its message starts the
    /// next turn); none when none ran, or without `interrupt`.
    pub interrupted: Option<String>,
    /// For a replay, where the first send saw the session's events end
    /// (see [`IdempotencyRecord::events_after`]).
    pub events_after: Option<i64>,
}

/// What sending a user message did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SendOutcome {
    /// The message was queued; it starts a turn.
    Queued,
    /// A message with the same idempotency key and text was queued before:
    /// nothing was queued now, and the first send's answer stands.
    Replayed,
    /// The text is blank: nothing was queued.
    Blank,
}
