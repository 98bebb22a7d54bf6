//! The Steps of AgentSessionFlow, as the spec's Step table describes them.
//! Each Step reads committed state, calls a guest in a fresh sandbox when it
//! must, and returns its writes, events and next Steps to commit in one
//! transaction.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::json;

use super::events::{fits, session_event, BackgroundHeartbeat, StepEvents, StepHeartbeats};
use super::flow::{AgentComponents, AgentSessionOptions};
use super::records::*;
use crate::flow::{
    ChannelWait, Json, MapQuery, StateAnswer, StateQuery, StateWrite, StepCall, StepContext,
    StepError, StepResult, StoreMillis,
};
use crate::plugin::wit::{self, DeferredToolExecution, ToolError, TurnContext, TurnOutcome};
use crate::plugin::{CallEnv, StepTag, ToolPolicies};

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
}

/// How long `build-user-message` may run.
const BUILD_USER_MESSAGE_TIMEOUT: Duration = Duration::from_secs(60);

/// The text of the turn-failure note, one line per final record in deferral
/// order.
pub fn turn_failure_note(records: &[AgentToolCall]) -> String {
    let mut note = String::from("[Dex] The previous turn failed after these tool calls ran:\n");
    for record in records {
        note.push_str(&format!(
            "- {} {} -> {}: {}\n",
            record.tool_name,
            record.arguments,
            record.status.as_str(),
            record.describe_outcome()
        ));
    }
    note.push_str("Do not repeat these tool calls unless the user asks again.");
    note
}

/// Why a ToolCallsRequested is refused (the turn then fails).
pub fn check_tool_calls_requested(
    request: &wit::ToolCallsRequested,
    earlier: &[AgentToolCall],
) -> Result<(), String> {
    if request.framework_run_state.is_empty() {
        return Err("framework_run_state is empty".to_string());
    }
    if request.tool_calls.is_empty() {
        return Err("it requests no tool calls".to_string());
    }
    let mut seen: HashSet<&str> = earlier.iter().map(|r| r.tool_call_id.as_str()).collect();
    for call in &request.tool_calls {
        let id = call.tool_call_id.as_str();
        if id.is_empty() {
            return Err(format!(
                "tool {:?} has an empty tool call id",
                call.tool_name
            ));
        }
        if id.contains('/') {
            return Err(format!("tool call id {id:?} contains '/'"));
        }
        if !seen.insert(id) {
            return Err(format!("tool call id {id:?} is not unique within the turn"));
        }
    }
    Ok(())
}

/// Rounds a store time up to a whole second.
fn round_up_to_second(at: StoreMillis) -> StoreMillis {
    let whole = at.div_euclid(1000).saturating_mul(1000);
    if at.rem_euclid(1000) == 0 {
        whole
    } else {
        whole.saturating_add(1000)
    }
}

fn fatal(message: impl Into<String>) -> StepError {
    StepError::fatal(message)
}

fn retryable(message: impl Into<String>) -> StepError {
    StepError::retryable(message)
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
    match deadline {
        Some(at) => call.wake_at(at),
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
            session_event(
                tag,
                event_type::TOOL_CALL_FINISHED,
                json!({
                    "tool_call_id": record.tool_call_id,
                    "tool_name": record.tool_name,
                    "status": record.status.as_str(),
                }),
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
    ) -> CallEnv {
        CallEnv::new(tag)
            .with_timeout(timeout)
            .with_events(events.sink())
            .with_heartbeats(Arc::new(StepHeartbeats(ctx.heartbeat_handle())))
            .with_policy(self.policies.clone())
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

    /// `build-user-message`, in a fresh sandbox; its role must be `user`.
    async fn user_message(
        &self,
        ctx: &StepContext,
        tag: &StepTag,
        text: &str,
    ) -> Result<wit::FrameworkMessage, StepError> {
        let components = self.components()?;
        let events = StepEvents::start(ctx, self.options.events_capacity);
        let env = self.env(ctx, tag.clone(), &events, BUILD_USER_MESSAGE_TIMEOUT);
        let message = components.runner.build_user_message(env, text).await;
        let leftovers = events.finish().await;
        if !leftovers.is_empty() {
            // Best effort, like every live event.
            if let Err(err) = ctx.append_stream(AGENT_EVENTS, leftovers).await {
                tracing::warn!(error = %err, "dropping the live events of build-user-message");
            }
        }
        let message = message.map_err(|err| retryable(err.to_string()))?;
        if message.role != wit::MessageRole::User {
            return Err(retryable(format!(
                "build-user-message returned a message with role {:?}; it must be user",
                MessageRole::from(message.role)
            )));
        }
        Ok(message)
    }

    /// Stores the user's message and starts the next turn.
    async fn begin_turn(
        &self,
        ctx: &StepContext,
        mut state: AgentState,
        text: &str,
        result: StepResult,
    ) -> Result<StepResult, StepError> {
        let number = state.turn_count + 1;
        let turn = turn_id(number);
        let tag = Self::tag(ctx, &turn);
        let message = self.user_message(ctx, &tag, text).await?;
        let sequence = state.message_count + 1;
        state.turn_count = number;
        state.active_turn_id = Some(turn.clone());
        state.message_count = sequence;
        state.status = SessionStatus::RunningModel;
        let stored = AgentMessage::from_framework(sequence, &turn, &message);
        Ok(StepResult::go_to(run_model_call())
            .with_writes(result.writes)
            .set_entry(
                AGENT_MESSAGES,
                &message_sequence_key(sequence),
                to_json(&stored),
            )
            .set(AGENT_STATE, to_json(&state))
            .append(
                AGENT_EVENTS,
                session_event(
                    &tag,
                    event_type::TURN_STARTED,
                    json!({"sequence": sequence}),
                ),
            ))
    }

    pub async fn start_agent_session(
        self: Arc<Self>,
        ctx: StepContext,
    ) -> Result<StepResult, StepError> {
        let input: AgentSessionStartInput = match ctx.input() {
            Json::Null => AgentSessionStartInput::default(),
            other => decode("the session's start input", other.clone())?,
        };
        ctx.store()
            .set_stream_capacity(ctx.flow_id(), AGENT_EVENTS, self.options.events_capacity)
            .await?;
        let state = AgentState::new();
        let result = StepResult::go_to(await_user_message_call())
            .set(AGENT_USAGE, to_json(&AgentUsage::default()));
        match input.initial_message.as_deref() {
            Some(text) if !text.trim().is_empty() => {
                self.begin_turn(&ctx, state, text, result).await
            }
            _ => Ok(result.set(AGENT_STATE, to_json(&state))),
        }
    }

    pub async fn await_user_message(
        self: Arc<Self>,
        ctx: StepContext,
    ) -> Result<StepResult, StepError> {
        let Some(message) = ctx.messages().first() else {
            return Ok(StepResult::go_to(await_user_message_call()));
        };
        let user: AgentUserMessage = decode("a queued user message", message.payload.clone())?;
        if user.text.trim().is_empty() {
            return Ok(StepResult::go_to(await_user_message_call()));
        }
        let state = Self::state(&ctx).await?;
        self.begin_turn(&ctx, state, &user.text, StepResult::end())
            .await
    }

    pub async fn run_model(self: Arc<Self>, ctx: StepContext) -> Result<StepResult, StepError> {
        let components = self.components()?.clone();
        // Everything RunModel reads, in one round trip from one snapshot.
        let mut answers = ctx
            .read_state(vec![
                StateQuery::get(AGENT_STATE, ""),
                StateQuery::map(AGENT_MESSAGES, MapQuery::default()),
                StateQuery::get(FRAMEWORK_RUN_STATE, ""),
                StateQuery::map(AGENT_TOOL_CALLS, MapQuery::default()),
                StateQuery::get(AGENT_USAGE, ""),
            ])
            .await?
            .into_iter();
        let mut state: AgentState = value_of(answers.next(), "the session state")?
            .ok_or_else(|| fatal("the session has no state"))?;
        let turn = state
            .active_turn_id
            .clone()
            .ok_or_else(|| fatal("RunModel ran with no active turn"))?;
        let messages: Vec<AgentMessage> = entries_of(answers.next(), "message")?;
        let messages = messages.iter().map(AgentMessage::to_wit).collect();
        let run_state: Option<String> = value_of(answers.next(), "the run state")?;
        let mut records: Vec<AgentToolCall> = entries_of(answers.next(), "tool call record")?;
        records.sort_by_key(|r| r.deferral_order);
        let mut usage: AgentUsage =
            value_of(answers.next(), "the session usage")?.unwrap_or_default();
        let turn_context = TurnContext {
            flow_id: ctx.flow_id().to_string(),
            turn_id: turn.clone(),
            attempt: ctx.attempt(),
            messages,
            framework_run_state: run_state,
            tool_calls: records.iter().map(AgentToolCall::to_wit).collect(),
            tools: components.tool_specs.clone(),
        };
        let tag = Self::tag(&ctx, &turn);
        let events = StepEvents::start(&ctx, self.options.events_capacity);
        let outcome = {
            let _beat = BackgroundHeartbeat::start(ctx.heartbeat_handle());
            let timeout = self.options.model_step_timeout;
            let mut env = self.env(&ctx, tag.clone(), &events, timeout);
            if let Some(model) = &components.model {
                env = env.with_model(model.clone());
            }
            components.runner.run_model_step(env, turn_context).await
        };
        let leftovers = events.finish().await;
        let result: Result<StepResult, StepError> = async {
            let outcome = match outcome {
                Err(err) => return Err(retryable(err.to_string())),
                Ok(Err(message)) => {
                    return Err(retryable(format!("run-model-step failed: {message}")))
                }
                Ok(Ok(outcome)) => outcome,
            };
            let recorded = AgentUsage::of(match &outcome {
                TurnOutcome::Completed(done) => &done.usage,
                TurnOutcome::ToolCallsRequested(request) => &request.usage,
            });
            usage.add(&recorded);
            let usage_event = session_event(
                &tag,
                event_type::USAGE_RECORDED,
                json!({"recorded": recorded, "session": usage}),
            );
            match outcome {
                TurnOutcome::Completed(done) => {
                    let mut result = StepResult::go_to(await_user_message_call());
                    let count = done.new_messages.len() as u64;
                    for (offset, message) in done.new_messages.iter().enumerate() {
                        let sequence = state.message_count + 1 + offset as u64;
                        let stored = AgentMessage::from_framework(sequence, &turn, message);
                        result = result.set_entry(
                            AGENT_MESSAGES,
                            &message_sequence_key(sequence),
                            to_json(&stored),
                        );
                    }
                    state.message_count += count;
                    state.status = SessionStatus::WaitingForUserMessage;
                    state.active_turn_id = None;
                    state.last_turn_error = None;
                    Ok(result
                        .clear(AGENT_TOOL_CALLS)
                        .delete(FRAMEWORK_RUN_STATE, "")
                        .clear(PENDING_INTERRUPTS)
                        .set(AGENT_USAGE, to_json(&usage))
                        .set(AGENT_STATE, to_json(&state))
                        .append(AGENT_EVENTS, usage_event)
                        .append(
                            AGENT_EVENTS,
                            session_event(
                                &tag,
                                event_type::TURN_COMPLETED,
                                json!({"message_count": count}),
                            ),
                        ))
                }
                TurnOutcome::ToolCallsRequested(request) => {
                    check_tool_calls_requested(&request, &records).map_err(|reason| {
                        fatal(format!(
                            "the runner's tool-calls-requested is invalid: {reason}"
                        ))
                    })?;
                    let now = ctx.now().await?;
                    let deadline = self.options.interrupt_deadline.map(|after| {
                        let after = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
                        round_up_to_second(now.saturating_add(after))
                    });
                    let mut next = Vec::with_capacity(request.tool_calls.len() + 1);
                    let mut result = StepResult::end()
                        .set(FRAMEWORK_RUN_STATE, json!(request.framework_run_state))
                        .set(AGENT_USAGE, to_json(&usage))
                        .append(AGENT_EVENTS, usage_event);
                    for (index, call) in request.tool_calls.iter().enumerate() {
                        // The operator's explicit policy wins over what the runner says.
                        let (effect, requires_approval) =
                            match self.options.tool_policies.get(&call.tool_name) {
                                Some(explicit) => (
                                    explicit.effect,
                                    explicit.requires_approval.unwrap_or_else(|| {
                                        crate::plugin::factors::policy::is_approval_required(
                                            explicit.effect.into(),
                                        )
                                    }),
                                ),
                                // A runner may ask for an approval the effect
                                // does not need, but never skip one it does.
                                None => {
                                    let effect: ToolEffect = call.policy.effect.into();
                                    let required =
                                        crate::plugin::factors::policy::is_approval_required(
                                            effect.into(),
                                        );
                                    (effect, call.policy.requires_approval || required)
                                }
                            };
                        let record = AgentToolCall {
                            tool_call_id: call.tool_call_id.clone(),
                            turn_id: turn.clone(),
                            tool_name: call.tool_name.clone(),
                            arguments: call.arguments.clone(),
                            effect,
                            requires_approval,
                            status: if requires_approval {
                                ToolCallStatus::Pending
                            } else {
                                ToolCallStatus::Approved
                            },
                            output: None,
                            error: None,
                            rejection_message: None,
                            deferral_order: (records.len() + index) as u32,
                        };
                        result = result
                            .set_entry(AGENT_TOOL_CALLS, &record.tool_call_id, to_json(&record))
                            .append(
                                AGENT_EVENTS,
                                session_event(
                                    &tag,
                                    event_type::TOOL_CALL_DEFERRED,
                                    json!({
                                        "tool_call_id": record.tool_call_id,
                                        "tool_name": record.tool_name,
                                        "effect": effect.as_str(),
                                        "requires_approval": requires_approval,
                                    }),
                                ),
                            );
                        if requires_approval {
                            let interrupt = AgentInterrupt {
                                interrupt_id: interrupt_id(&turn, &record.tool_call_id),
                                turn_id: turn.clone(),
                                tool_call_id: record.tool_call_id.clone(),
                                tool_name: record.tool_name.clone(),
                                arguments: record.arguments.clone(),
                                deadline,
                            };
                            result = result
                                .set_entry(
                                    PENDING_INTERRUPTS,
                                    &interrupt.interrupt_id,
                                    to_json(&interrupt),
                                )
                                .append(
                                    AGENT_EVENTS,
                                    session_event(
                                        &tag,
                                        event_type::INTERRUPT_RAISED,
                                        json!({
                                            "interrupt_id": interrupt.interrupt_id,
                                            "tool_call_id": interrupt.tool_call_id,
                                            "tool_name": interrupt.tool_name,
                                            "deadline": deadline,
                                        }),
                                    ),
                                );
                            next.push(await_approval_call(
                                &record.tool_call_id,
                                &interrupt.interrupt_id,
                                deadline,
                            ));
                        } else {
                            next.push(tool_step_call(effect, &record.tool_call_id));
                        }
                    }
                    next.push(resume_turn_call(request.tool_calls.len() as u32));
                    state.status = SessionStatus::RunningTools;
                    Ok(StepResult::go_to_many(next)
                        .with_writes(result.writes)
                        .set(AGENT_STATE, to_json(&state)))
                }
            }
        }
        .await;
        settle(&ctx, leftovers, result).await
    }

    pub async fn await_tool_approval(
        self: Arc<Self>,
        ctx: StepContext,
    ) -> Result<StepResult, StepError> {
        // A final (or cleared) record ends the Step without running it.
        let Some((id, mut record)) = Self::open_record(&ctx).await? else {
            return Ok(StepResult::end());
        };
        let tag = Self::tag(&ctx, &record.turn_id);
        let interrupt = interrupt_id(&record.turn_id, &id);
        let resolved = |approved: bool, rejection: &Option<String>, expired: bool| {
            session_event(
                &tag,
                event_type::INTERRUPT_RESOLVED,
                json!({
                    "interrupt_id": interrupt,
                    "approved": approved,
                    "rejection_message": rejection,
                    "expired": expired,
                }),
            )
        };
        if let Some(message) = ctx.messages().first() {
            let answer: AgentInterruptResolution =
                decode("an interrupt resolution", message.payload.clone())?;
            let base = StepResult::end()
                .delete(PENDING_INTERRUPTS, &interrupt)
                .append(
                    AGENT_EVENTS,
                    resolved(answer.approved, &answer.rejection_message, false),
                );
            if answer.approved {
                record.status = ToolCallStatus::Approved;
                return Ok(StepResult::go_to(tool_step_call(record.effect, &id))
                    .with_writes(base.writes)
                    .set_entry(AGENT_TOOL_CALLS, &id, to_json(&record)));
            }
            record.status = ToolCallStatus::Rejected;
            record.rejection_message = answer.rejection_message;
            return Ok(finalize(&tag, &record, base));
        }
        let pending: Option<AgentInterrupt> = ctx.get_value(PENDING_INTERRUPTS, &interrupt).await?;
        let deadline = pending.and_then(|p| p.deadline);
        let now = ctx.now().await?;
        match deadline {
            Some(at) if now >= at => {
                record.status = ToolCallStatus::Rejected;
                record.rejection_message =
                    Some("the approval request expired before anyone answered it".to_string());
                let base = StepResult::end()
                    .delete(PENDING_INTERRUPTS, &interrupt)
                    .append(
                        AGENT_EVENTS,
                        resolved(false, &record.rejection_message, true),
                    );
                Ok(finalize(&tag, &record, base))
            }
            // Woken early (or with nothing to apply): wait again.
            _ => Ok(StepResult::go_to(await_approval_call(
                &id, &interrupt, deadline,
            ))),
        }
    }

    pub async fn call_tool(self: Arc<Self>, ctx: StepContext) -> Result<StepResult, StepError> {
        let components = self.components()?.clone();
        // A final (or cleared) record ends the Step without running it.
        let Some((id, mut record)) = Self::open_record(&ctx).await? else {
            return Ok(StepResult::end());
        };
        if record.status == ToolCallStatus::Pending {
            return Err(fatal(format!(
                "tool call {id} runs only after it is approved"
            )));
        }
        let tag = Self::tag(&ctx, &record.turn_id);
        // Durable output before the tool runs: a lost worker now means the
        // next attempt (or the failure route), never a silent second run.
        let started = session_event(
            &tag,
            event_type::TOOL_CALL_STARTED,
            json!({"tool_call_id": id, "tool_name": record.tool_name}),
        );
        let started: Vec<Json> = std::iter::once(started)
            .filter(|event| fits(event, self.options.events_capacity))
            .collect();
        ctx.heartbeat_with_events(AGENT_EVENTS, started).await?;
        let execution = DeferredToolExecution {
            flow_id: ctx.flow_id().to_string(),
            turn_id: record.turn_id.clone(),
            tool_call: record.to_wit(),
            idempotency_key: idempotency_key(ctx.flow_id(), &record.turn_id, &id),
            attempt: ctx.attempt(),
        };
        let events = StepEvents::start(&ctx, self.options.events_capacity);
        let result = {
            let _beat = BackgroundHeartbeat::start(ctx.heartbeat_handle());
            let env = self.env(
                &ctx,
                tag.clone(),
                &events,
                self.options.tool_attempt_timeout,
            );
            match components.tool_for(&record.tool_name) {
                Some(tool) => tool.call(env, &execution).await,
                None => {
                    components
                        .runner
                        .execute_deferred_tool_call(env, &execution)
                        .await
                }
            }
        };
        let leftovers = events.finish().await;
        let result: Result<StepResult, StepError> = async {
            match result {
                Ok(Ok(output)) => {
                    record.status = ToolCallStatus::Succeeded;
                    record.output = Some(output);
                }
                Ok(Err(ToolError::Execution(message))) => {
                    record.status = ToolCallStatus::Failed;
                    record.error = Some(message);
                }
                Ok(Err(ToolError::Internal(message))) => {
                    return Err(retryable(format!(
                        "tool {} failed: {message}",
                        record.tool_name
                    )))
                }
                Err(err) => return Err(retryable(err.to_string())),
            }
            Ok(finalize(&tag, &record, StepResult::end()))
        }
        .await;
        settle(&ctx, leftovers, result).await
    }

    async fn record_failure(
        ctx: StepContext,
        always_unknown: bool,
    ) -> Result<StepResult, StepError> {
        // A final (or cleared) record ends the Step without running it.
        let Some((_, mut record)) = Self::open_record(&ctx).await? else {
            return Ok(StepResult::end());
        };
        let detail = ctx.failure().unwrap_or("the tool Step failed");
        record.status = if !always_unknown && record.effect == ToolEffect::Read {
            ToolCallStatus::Failed
        } else {
            ToolCallStatus::OutcomeUnknown
        };
        record.error = Some(format!("the tool call did not complete: {detail}"));
        let tag = Self::tag(&ctx, &record.turn_id);
        Ok(finalize(&tag, &record, StepResult::end()))
    }

    pub async fn record_tool_failure(
        self: Arc<Self>,
        ctx: StepContext,
    ) -> Result<StepResult, StepError> {
        Self::record_failure(ctx, false).await
    }

    pub async fn record_tool_outcome_unknown(
        self: Arc<Self>,
        ctx: StepContext,
    ) -> Result<StepResult, StepError> {
        Self::record_failure(ctx, true).await
    }

    pub async fn resume_turn(self: Arc<Self>, ctx: StepContext) -> Result<StepResult, StepError> {
        let mut answers = ctx
            .read_state(vec![
                StateQuery::map(AGENT_TOOL_CALLS, MapQuery::default()),
                StateQuery::get(AGENT_STATE, ""),
            ])
            .await?
            .into_iter();
        let records: Vec<AgentToolCall> = entries_of(answers.next(), "tool call record")?;
        let unfinished = records.iter().filter(|r| !r.status.is_final()).count() as u32;
        if unfinished > 0 {
            return Ok(StepResult::go_to(resume_turn_call(unfinished)));
        }
        let mut state: AgentState = value_of(answers.next(), "the session state")?
            .ok_or_else(|| fatal("the session has no state"))?;
        state.status = SessionStatus::RunningModel;
        Ok(StepResult::go_to(run_model_call()).set(AGENT_STATE, to_json(&state)))
    }

    pub async fn record_turn_failure(
        self: Arc<Self>,
        ctx: StepContext,
    ) -> Result<StepResult, StepError> {
        let mut state = Self::state(&ctx).await?;
        let turn = state
            .active_turn_id
            .clone()
            .unwrap_or_else(|| turn_id(state.turn_count));
        let tag = Self::tag(&ctx, &turn);
        let error = ctx.failure().unwrap_or("the turn failed").to_string();
        let finished: Vec<AgentToolCall> = Self::records(&ctx)
            .await?
            .into_iter()
            .filter(|r| r.status.is_final())
            .collect();
        let mut result = StepResult::go_to(await_user_message_call());
        if !finished.is_empty() {
            let note = self
                .user_message(&ctx, &tag, &turn_failure_note(&finished))
                .await?;
            let sequence = state.message_count + 1;
            state.message_count = sequence;
            let stored = AgentMessage::from_framework(sequence, &turn, &note);
            result = result.set_entry(
                AGENT_MESSAGES,
                &message_sequence_key(sequence),
                to_json(&stored),
            );
        }
        state.status = SessionStatus::WaitingForUserMessage;
        state.active_turn_id = None;
        state.last_turn_error = Some(error.clone());
        Ok(result
            .clear(AGENT_TOOL_CALLS)
            .delete(FRAMEWORK_RUN_STATE, "")
            .clear(PENDING_INTERRUPTS)
            .set(AGENT_STATE, to_json(&state))
            .append(
                AGENT_EVENTS,
                session_event(&tag, event_type::TURN_FAILED, json!({"error": error})),
            ))
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
