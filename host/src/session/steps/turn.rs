//! The Steps around a turn's user message: StartAgentSession,
//! AwaitUserMessage and RecordTurnFailure, which have no failure route and
//! so give a message (or a note) up on their last attempt rather than fail
//! the session.

use super::*;

/// How often a user message goes back to the queue because the runner never
/// ran, before it is given up like any other failure.
const MAX_REQUEUES: u32 = 3;

/// The text of the turn-failure note, one line per final record in deferral
/// order. The host builds it, so the host bounds it: each call's arguments
/// and outcome are quoted up to a cap, and past [`NOTE_BYTES`] calls are
/// counted instead of listed, so that the note always fits what
/// `build-user-message` may return.
pub fn turn_failure_note(records: &[AgentToolCall]) -> String {
    tool_call_note(
        "[Dex] The previous turn failed after these tool calls ran:\n",
        records,
    )
}

/// A note that starts with `header` and lists `records` as
/// [`turn_failure_note`] does.
pub(super) fn tool_call_note(header: &str, records: &[AgentToolCall]) -> String {
    let mut note = String::from(header);
    let mut unlisted = 0;
    for record in records {
        let line = format!(
            "- {} {} -> {}: {}\n",
            cut(&record.tool_name, NOTE_ARGUMENTS_BYTES, "the name is long"),
            cut(
                &record.arguments,
                NOTE_ARGUMENTS_BYTES,
                "the note quotes arguments in part"
            ),
            record.status.as_str(),
            cut(
                &record.describe_outcome(),
                NOTE_OUTCOME_BYTES,
                "the note quotes outcomes in part"
            )
        );
        if unlisted > 0 || note.len() + line.len() > NOTE_BYTES {
            unlisted += 1;
        } else {
            note.push_str(&line);
        }
    }
    if unlisted > 0 {
        note.push_str(&format!("- and {unlisted} more tool calls, not listed\n"));
    }
    note.push_str("Do not repeat these tool calls unless the user asks again.");
    note
}

impl SessionSteps {
    /// `build-user-message` of `runner`, in a fresh sandbox; its role must
    /// be `user`.
    pub(super) async fn user_message(
        &self,
        ctx: &StepContext,
        tag: &StepTag,
        text: &str,
        runner: &PinnedRunner,
    ) -> Result<wit::FrameworkMessage, StepError> {
        ctx.record_component(&runner.digest);
        let events = StepEvents::start(ctx, self.options.events_capacity, HashSet::new());
        let policies = self.session_policies(ctx).await;
        let env = self.env(
            ctx,
            tag.clone(),
            &events,
            BUILD_USER_MESSAGE_TIMEOUT,
            policies,
        );
        let message = runner.runner.build_user_message(env, text).await;
        let leftovers = events.finish().await;
        if !leftovers.is_empty() {
            // Best effort, like every live event.
            if let Err(err) = ctx.append_stream(AGENT_EVENTS, leftovers).await {
                tracing::warn!(error = %err, "dropping the live events of build-user-message");
            }
        }
        let message = message.map_err(|err| {
            if err.never_ran() {
                retryable(format!("{NOT_STARTED}{err}"))
            } else {
                retryable(err.to_string())
            }
        })?;
        if message.role != wit::MessageRole::User {
            return Err(retryable(format!(
                "build-user-message returned a message with role {:?}; it must be user",
                MessageRole::from(message.role)
            )));
        }
        Ok(message)
    }

    /// Builds `text` into a note with the turn's pinned runner and adds it to
    /// `result` as the turn's next message. These Steps have no failure
    /// route: on the last attempt a note that cannot be built is left out,
    /// and why is returned for the caller to report.
    pub(super) async fn add_turn_note(
        &self,
        ctx: &StepContext,
        tag: &StepTag,
        state: &mut AgentState,
        text: &str,
        result: StepResult,
    ) -> Result<(StepResult, Option<String>), StepError> {
        let built = match self.turn_runner(ctx, state).await {
            Ok(runner) => self.user_message(ctx, tag, text, &runner).await,
            Err(err) => Err(retryable(err.to_string())),
        };
        match built {
            Ok(note) => {
                let sequence = state.message_count + 1;
                state.message_count = sequence;
                let stored = AgentMessage::from_framework(sequence, &tag.turn_id, &note);
                let result = result.set_entry(
                    AGENT_MESSAGES,
                    &message_sequence_key(sequence),
                    to_json(&stored),
                );
                Ok((result, None))
            }
            Err(err) if last_attempt(ctx) => Ok((result, Some(err.to_string()))),
            Err(err) => Err(err),
        }
    }

    /// Stores the user's message and starts the next turn.
    pub(super) async fn begin_turn(
        &self,
        ctx: &StepContext,
        mut state: AgentState,
        user: &AgentUserMessage,
        result: StepResult,
    ) -> Result<StepResult, StepError> {
        let number = state.turn_count + 1;
        let turn = turn_id(number);
        let tag = Self::tag(ctx, &turn);
        let text = user.text.as_str();
        // This attempt is the turn's first: it reports into the turn's trace.
        state.turn_trace = user.trace.clone();
        join_turn_trace(ctx, state.turn_trace.as_ref(), &turn);
        // A new turn takes the version active for this session now (or its
        // ramp's), and keeps it to its end.
        // These Steps have no failure route, so a version they cannot have
        // is retried, and then gives the message up with the reason; one
        // the store could not hand over (it did not answer) never ran, so
        // the message waits in the queue instead.
        let pinned = self
            .components()?
            .new_turn_runner(ctx.flow_id())
            .await
            .map_err(|err| match err {
                VersionError::Unavailable(_) => retryable(format!("{NOT_STARTED}{err}")),
                VersionError::Missing(_) | VersionError::Invalid(_) => retryable(err.to_string()),
            });
        let built = match &pinned {
            Ok(runner) => self.user_message(ctx, &tag, text, runner).await,
            Err(err) => Err(err.clone()),
        };
        let message = match built {
            Ok(message) => message,
            // These Steps have no failure route: on the last attempt the
            // message is given up (and consumed) with the reason recorded,
            // and the session waits for the next one, instead of failing.
            // The runner never ran (no free instance, say, because other
            // sessions fill its slots): nothing is wrong with the message,
            // so it goes back to the end of the queue, a few times at most
            // (a sandbox that cannot be set up at all would loop forever).
            Err(err)
                if last_attempt(ctx)
                    && err.to_string().starts_with(NOT_STARTED)
                    && user.requeued < MAX_REQUEUES =>
            {
                tracing::warn!(flow_id = %ctx.flow_id(), error = %err, "queueing a user message again");
                let again = to_json(&AgentUserMessage {
                    text: text.to_string(),
                    requeued: user.requeued + 1,
                    message_id: user.message_id.clone(),
                    trace: user.trace.clone(),
                });
                // The message waits again, outside any turn.
                state.turn_trace = None;
                return Ok(StepResult::go_to(await_user_message_call())
                    .with_writes(result.writes)
                    .set(AGENT_STATE, to_json(&state))
                    .publish(QUEUED_USER_MESSAGES, "", again));
            }
            Err(err) if last_attempt(ctx) => {
                let error = format!("the user message could not be used: {err}");
                tracing::warn!(flow_id = %ctx.flow_id(), %error, "a turn failed at its start");
                state.turn_count = number;
                state.active_turn_id = None;
                state.status = SessionStatus::WaitingForUserMessage;
                state.last_turn_error = Some(error.clone());
                state.end_turn_trace(ctx, &turn, "failed");
                return Ok(StepResult::go_to(await_user_message_call())
                    .with_writes(result.writes)
                    .set(AGENT_STATE, to_json(&state))
                    .append(
                        AGENT_EVENTS,
                        host_event(
                            &tag,
                            &TurnFailed {
                                error,
                                message_id: Some(user.message_id.clone()),
                            },
                        ),
                    ));
            }
            Err(err) => return Err(err),
        };
        let sequence = state.message_count + 1;
        state.turn_count = number;
        state.active_turn_id = Some(turn.clone());
        state.message_count = sequence;
        state.status = SessionStatus::RunningModel;
        state.runner_digest = pinned.ok().map(|p| p.digest);
        let runner = state.runner_digest.clone();
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
                host_event(
                    &tag,
                    &TurnStarted {
                        sequence,
                        runner,
                        message_id: user.message_id.clone(),
                    },
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
                let user = AgentUserMessage {
                    text: text.to_string(),
                    requeued: 0,
                    message_id: None,
                    trace: input.initial_trace.clone(),
                };
                self.begin_turn(&ctx, state, &user, result).await
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
        self.begin_turn(&ctx, state, &user, StepResult::end()).await
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
        let mut error = error;
        if !finished.is_empty() {
            // The note is the turn's own: its pinned runner builds it.
            let (noted, unbuilt) = self
                .add_turn_note(
                    &ctx,
                    &tag,
                    &mut state,
                    &turn_failure_note(&finished),
                    result,
                )
                .await?;
            result = noted;
            if let Some(err) = unbuilt {
                error = format!("{error} (and its failure note could not be built: {err})");
            }
        }
        state.status = SessionStatus::WaitingForUserMessage;
        state.active_turn_id = None;
        state.last_turn_error = Some(error.clone());
        state.runner_digest = None;
        state.end_turn_trace(&ctx, &turn, "failed");
        Ok(result
            .clear(AGENT_TOOL_CALLS)
            .delete(FRAMEWORK_RUN_STATE, "")
            .clear(PENDING_INTERRUPTS)
            .set(AGENT_STATE, to_json(&state))
            .append(
                AGENT_EVENTS,
                host_event(
                    &tag,
                    &TurnFailed {
                        error,
                        message_id: None,
                    },
                ),
            ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn final_record(n: usize, output: String) -> AgentToolCall {
        AgentToolCall {
            tool_call_id: format!("c{n}"),
            turn_id: "turn-1".into(),
            tool_name: "read_file".into(),
            arguments: "x".repeat(10_000),
            effect: ToolEffect::Read,
            requires_approval: false,
            status: ToolCallStatus::Succeeded,
            output: Some(output),
            error: None,
            rejection_message: None,
            deferral_order: n as u32,
            output_limit: None,
            component: None,
            digest: None,
        }
    }

    #[test]
    fn the_turn_failure_note_is_bounded_whatever_the_outputs() {
        let records: Vec<AgentToolCall> = (0..300)
            .map(|n| final_record(n, "a".repeat(1 << 20)))
            .collect();
        let note = turn_failure_note(&records);
        assert!(note.len() <= NOTE_BYTES + 200, "{} bytes", note.len());
        assert!(note.contains("more bytes cut: the note quotes outcomes in part"));
        assert!(note.ends_with("Do not repeat these tool calls unless the user asks again."));
        let listed = note
            .lines()
            .filter(|l| l.starts_with("- read_file"))
            .count();
        assert!(note.contains(&format!(
            "- and {} more tool calls, not listed",
            300 - listed
        )));
    }
}
