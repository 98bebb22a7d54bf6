//! The Steps of AgentSessionFlow, as the spec's Step table describes them.
//! Each Step reads committed state, calls a guest in a fresh sandbox when it
//! must, and returns its writes, events and next Steps to commit in one
//! transaction.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;

use super::components::{AgentComponents, PinnedRunner, ToolSet, VersionError};
use super::event_data::{
    host_event, HistoryCompacted, InterruptRaised, InterruptResolved, ToolCallDeferred,
    ToolCallFinished, ToolCallStarted, TurnCancelled, TurnCompleted, TurnFailed, TurnStarted,
    UsageRecorded, VersionChanged,
};
use super::events::{BackgroundHeartbeat, StepEvents, StepHeartbeats};
use super::history::{check_compaction, newest_compaction_query, AgentCompaction, StoredHistory};
use super::limits::{
    cut, output_share, ERROR_TEXT_BYTES, NOTE_ARGUMENTS_BYTES, NOTE_BYTES, NOTE_OUTCOME_BYTES,
};
use super::options::AgentSessionOptions;
use super::policy::ToolPolicies;
use super::records::*;
use crate::flow::{
    ChannelWait, Json, MapQuery, StateAnswer, StateQuery, StateWrite, StepCall, StepContext,
    StepError, StepResult, StoreMillis,
};
use crate::plugin::wit::{self, DeferredToolExecution, ToolError, TurnOutcome};
use crate::plugin::TurnInput;
use crate::plugin::{CallEnv, CallError, RunnerComponent, StepTag, ToolComponent};
use crate::telemetry::traces::TurnTrace;

mod cancel;
mod model;
mod tools;
mod turn;

pub use cancel::{turn_cancelled_note, CancelTurnInput, TakenStep};
pub use model::check_tool_calls_requested;
pub use turn::turn_failure_note;

/// The Step type names.
pub mod step {
    pub const START_AGENT_SESSION: &str = "StartAgentSession";
    pub const AWAIT_USER_MESSAGE: &str = "AwaitUserMessage";
    pub const RUN_MODEL: &str = "RunModel";
    pub const AWAIT_TOOL_APPROVAL: &str = "AwaitToolApproval";
    pub const CALL_TOOL: &str = "CallTool";
    pub const CALL_SINGLE_ATTEMPT_TOOL: &str = "CallSingleAttemptTool";
    pub const RECORD_TOOL_FAILURE: &str = "RecordToolFailure";
    pub const RECORD_TOOL_OUTCOME_UNKNOWN: &str = "RecordToolOutcomeUnknown";
    pub const RESUME_TURN: &str = "ResumeTurn";
    pub const RECORD_TURN_FAILURE: &str = "RecordTurnFailure";
    pub const CANCEL_TURN: &str = "CancelTurn";
}

/// How a Step's failure begins when its guest call provably never ran (a
/// tool's "started" marker was not written, or no sandbox was started): the
/// single-attempt route then records the call `failed`, not
/// `outcome_unknown`, and a user message is queued again rather than given
/// up. Only the host writes this prefix; a guest's text always follows host
/// text.
pub const NOT_STARTED: &str = "the call never started: ";

/// How a tool Step's failure begins when its guest trapped (a panic, an
/// uncaught exception, a stack overflow; not a host import's refusal, whose
/// text the host wrote and the model may read). The trap's text is the guest's:
/// long, and possibly written to steer the model. So the model is told only
/// that the tool crashed; the Step history and the log keep the text. Only
/// the host writes this prefix.
pub const CRASHED: &str = "the tool crashed: ";

/// How long `build-user-message` may run.
const BUILD_USER_MESSAGE_TIMEOUT: Duration = Duration::from_secs(60);

/// Rounds a store time up to a whole second (the approval Timer's time).
fn round_up_to_second(at: StoreMillis) -> StoreMillis {
    let whole = at.div_euclid(1000).saturating_mul(1000);
    if at.rem_euclid(1000) == 0 {
        whole
    } else {
        whole.saturating_add(1000)
    }
}

/// Reports this attempt's span into `trace`, the trace of `turn`.
fn join_turn_trace(ctx: &StepContext, trace: Option<&TurnTrace>, turn: &str) {
    let Some(trace) = trace else {
        return;
    };
    match trace.as_parent() {
        Some(parent) => ctx.trace_under(
            parent,
            vec![opentelemetry::KeyValue::new("dexa.turn", turn.to_string())],
        ),
        // Its sender said not to record it (or its stored ids are
        // unreadable): none of its attempts is reported either.
        None => ctx.trace_unsampled(),
    }
}

/// With traces exported, reports this attempt's span into the open turn's
/// trace (read from the session's state; nothing between turns).
pub(crate) async fn join_open_turn(ctx: &StepContext) {
    if !crate::telemetry::traces::enabled() {
        return;
    }
    if let Ok(Some(state)) = ctx.get_value::<AgentState>(AGENT_STATE, "").await {
        if let Some(turn) = &state.active_turn_id {
            join_turn_trace(ctx, state.turn_trace.as_ref(), turn);
        }
    }
}

/// Whether this is the Step's last attempt under its retry policy.
fn last_attempt(ctx: &StepContext) -> bool {
    ctx.attempt() >= ctx.task().policy.max_attempts
}

/// A Step failure's text, cut to [`ERROR_TEXT_BYTES`]: it may quote what a
/// guest returned (an internal error, a runner's error string, its stderr),
/// and it is kept in the history, in the failure route's input and in
/// `last_turn_error`.
fn bounded(message: impl Into<String>) -> String {
    cut(
        &message.into(),
        ERROR_TEXT_BYTES,
        "a failure is quoted in part",
    )
}

fn fatal(message: impl Into<String>) -> StepError {
    StepError::fatal(bounded(message))
}

fn retryable(message: impl Into<String>) -> StepError {
    StepError::retryable(bounded(message))
}

/// A version a Step cannot have: missing or unusable versions fail the
/// Step at once (no other version may stand in); an unreadable store may
/// answer a later attempt.
fn version_error(err: VersionError) -> StepError {
    match err {
        VersionError::Missing(_) | VersionError::Invalid(_) => fatal(err.to_string()),
        VersionError::Unavailable(_) => retryable(err.to_string()),
    }
}

fn to_json<T: Serialize>(value: &T) -> Json {
    serde_json::to_value(value).unwrap_or(Json::Null)
}

fn decode<T: DeserializeOwned>(what: &str, value: Json) -> Result<T, StepError> {
    serde_json::from_value(value).map_err(|err| fatal(format!("{what} is unreadable: {err}")))
}

/// Decodes the answer to a [`StateQuery::Get`].
fn value_of<T: DeserializeOwned>(
    answer: Option<StateAnswer>,
    what: &str,
) -> Result<Option<T>, StepError> {
    match answer {
        Some(StateAnswer::Value(None)) => Ok(None),
        Some(StateAnswer::Value(Some(versioned))) => decode(what, versioned.value).map(Some),
        _ => Err(fatal(format!("the store answered no value for {what}"))),
    }
}

/// Decodes the answer to a [`StateQuery::Map`].
fn entries_of<T: DeserializeOwned>(
    answer: Option<StateAnswer>,
    what: &str,
) -> Result<Vec<T>, StepError> {
    match answer {
        Some(StateAnswer::Entries(entries)) => entries
            .into_iter()
            .map(|(key, versioned)| decode(&format!("{what} {key}"), versioned.value))
            .collect(),
        _ => Err(fatal(format!("the store answered no entries for {what}"))),
    }
}

fn await_user_message_call() -> StepCall {
    StepCall::new(step::AWAIT_USER_MESSAGE, Json::Null)
        .wait_for(ChannelWait::for_one(QUEUED_USER_MESSAGES))
}

fn run_model_call() -> StepCall {
    StepCall::new(step::RUN_MODEL, Json::Null)
}

fn tool_step_call(effect: ToolEffect, tool_call_id: &str) -> StepCall {
    let step_type = if effect.may_repeat() {
        step::CALL_TOOL
    } else {
        step::CALL_SINGLE_ATTEMPT_TOOL
    };
    StepCall::new(step_type, json!(tool_call_id))
}

fn await_approval_call(
    tool_call_id: &str,
    interrupt_id: &str,
    deadline: Option<StoreMillis>,
) -> StepCall {
    let call = StepCall::new(step::AWAIT_TOOL_APPROVAL, json!(tool_call_id))
        .wait_for(ChannelWait::for_key(INTERRUPT_RESOLUTIONS, interrupt_id));
    // The spec's Timer fires at the deadline rounded up to whole seconds;
    // the deadline itself (what resolve_interrupt enforces) is exact.
    match deadline {
        Some(at) => call.wake_at(round_up_to_second(at)),
        None => call,
    }
}

fn resume_turn_call(expected: u32) -> StepCall {
    StepCall::new(step::RESUME_TURN, json!(expected))
        .wait_for(ChannelWait::for_n(TOOL_CALL_RESULTS, expected))
}

/// The writes that make a tool call's record final: the record, its one
/// ToolCallResults message and its `tool_call_finished` event.
fn finalize(tag: &StepTag, record: &AgentToolCall, result: StepResult) -> StepResult {
    result
        .set_entry(AGENT_TOOL_CALLS, &record.tool_call_id, to_json(record))
        .publish(
            TOOL_CALL_RESULTS,
            "",
            to_json(&ToolCallCompleted {
                tool_call_id: record.tool_call_id.clone(),
                status: record.status,
            }),
        )
        .append(
            AGENT_EVENTS,
            host_event(
                tag,
                &ToolCallFinished {
                    tool_call_id: record.tool_call_id.clone(),
                    tool_name: record.tool_name.clone(),
                    status: record.status.as_str().to_string(),
                },
            ),
        )
}

/// Puts the call's last live events into the Step's commit, ahead of the
/// Step's own events; a failed attempt still writes them (best effort).
async fn settle(
    ctx: &StepContext,
    leftovers: Vec<Json>,
    result: Result<StepResult, StepError>,
) -> Result<StepResult, StepError> {
    if leftovers.is_empty() {
        return result;
    }
    match result {
        Ok(mut done) => {
            let mut writes: Vec<StateWrite> = leftovers
                .into_iter()
                .map(|payload| StateWrite::Append {
                    stream: AGENT_EVENTS.to_string(),
                    payload,
                })
                .collect();
            writes.append(&mut done.writes);
            done.writes = writes;
            Ok(done)
        }
        Err(err) => {
            if let Err(append) = ctx.append_stream(AGENT_EVENTS, leftovers).await {
                tracing::warn!(error = %append, "dropping the live events of a failed attempt");
            }
            Err(err)
        }
    }
}

/// The Steps of one agent.
pub(crate) struct SessionSteps {
    pub flow_type: String,
    pub options: AgentSessionOptions,
    /// The policies of a fixed tool set (a catalog's are decided per tool
    /// set, see [`SessionSteps::policies_for`]).
    pub policies: Arc<ToolPolicies>,
    pub components: Option<Arc<AgentComponents>>,
}

impl SessionSteps {
    fn components(&self) -> Result<&Arc<AgentComponents>, StepError> {
        self.components.as_ref().ok_or_else(|| {
            fatal(format!(
                "flow type {} was registered for clients only; its Steps have no components",
                self.flow_type
            ))
        })
    }

    /// The operator's policies with the effects `set` declares, which a
    /// runner cannot lower.
    fn policies_for(&self, set: &ToolSet) -> Arc<ToolPolicies> {
        if self.components.as_ref().is_none_or(|c| c.is_fixed()) {
            return self.policies.clone();
        }
        Arc::new(self.options.resolver().with_declared(set.specs.iter()))
    }

    /// The policies a session's runner calls answer with now.
    async fn session_policies(&self, ctx: &StepContext) -> Arc<ToolPolicies> {
        let Ok(components) = self.components() else {
            return self.policies.clone();
        };
        match components.tool_set(ctx.flow_id()).await {
            Ok(set) => self.policies_for(&set),
            Err(_) => self.policies.clone(),
        }
    }

    /// The runner of the open turn: its pin, or (for a turn stored before
    /// pins were kept) the version a new turn takes.
    async fn turn_runner(
        &self,
        ctx: &StepContext,
        state: &AgentState,
    ) -> Result<PinnedRunner, VersionError> {
        let components = self
            .components()
            .map_err(|err| VersionError::Missing(err.to_string()))?;
        match &state.runner_digest {
            Some(digest) => Ok(PinnedRunner {
                digest: digest.clone(),
                runner: components.runner(digest).await?,
            }),
            None => components.new_turn_runner(ctx.flow_id()).await,
        }
    }

    fn tag(ctx: &StepContext, turn_id: &str) -> StepTag {
        StepTag {
            flow_id: ctx.flow_id().to_string(),
            turn_id: turn_id.to_string(),
            step_execution_id: ctx.step_execution_id().to_string(),
            attempt: ctx.attempt(),
        }
    }

    fn env(
        &self,
        ctx: &StepContext,
        tag: StepTag,
        events: &StepEvents,
        timeout: Duration,
        policies: Arc<ToolPolicies>,
    ) -> CallEnv {
        CallEnv::new(tag)
            .with_timeout(timeout)
            .with_events(events.sink())
            .with_heartbeats(Arc::new(StepHeartbeats(ctx.heartbeat_handle())))
            .with_policy(policies)
    }

    async fn state(ctx: &StepContext) -> Result<AgentState, StepError> {
        ctx.get_value(AGENT_STATE, "")
            .await?
            .ok_or_else(|| fatal("the session has no state"))
    }

    async fn record(
        ctx: &StepContext,
        tool_call_id: &str,
    ) -> Result<Option<AgentToolCall>, StepError> {
        ctx.get_value(AGENT_TOOL_CALLS, tool_call_id).await
    }

    /// The active turn's tool-call records, in deferral order.
    async fn records(ctx: &StepContext) -> Result<Vec<AgentToolCall>, StepError> {
        let mut records = Vec::new();
        for (key, value) in ctx.read_map(AGENT_TOOL_CALLS, MapQuery::default()).await? {
            records.push(decode::<AgentToolCall>(
                &format!("tool call record {key}"),
                value.value,
            )?);
        }
        records.sort_by_key(|r| r.deferral_order);
        Ok(records)
    }

    /// The tool-call Step's id and record, unless the record is gone (the
    /// turn ended) or already final.
    async fn open_record(ctx: &StepContext) -> Result<Option<(String, AgentToolCall)>, StepError> {
        let id = Self::tool_call_id(ctx)?;
        Ok(Self::record(ctx, &id)
            .await?
            .filter(|record| !record.status.is_final())
            .map(|record| (id, record)))
    }

    fn tool_call_id(ctx: &StepContext) -> Result<String, StepError> {
        ctx.input().as_str().map(str::to_string).ok_or_else(|| {
            fatal(format!(
                "the Step's input {} is not a tool call id",
                ctx.input()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_round_up_to_whole_seconds() {
        assert_eq!(round_up_to_second(5_000), 5_000);
        assert_eq!(round_up_to_second(5_001), 6_000);
        assert_eq!(round_up_to_second(5_999), 6_000);
        assert_eq!(round_up_to_second(i64::MAX), i64::MAX, "saturates");
    }
}
