//! The tool Steps: AwaitToolApproval, CallTool and CallSingleAttemptTool,
//! their failure routes, and ResumeTurn.

use super::*;

/// The least of a failure's reason a record keeps, whatever its share.
const ERROR_FLOOR_BYTES: usize = 256;

impl SessionSteps {
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
        // (Dropped by the store if it cannot fit the stream.)
        ctx.heartbeat_with_events(AGENT_EVENTS, vec![started])
            .await
            .map_err(|err| retryable(format!("{NOT_STARTED}{err}")))?;
        let execution = DeferredToolExecution {
            flow_id: ctx.flow_id().to_string(),
            turn_id: record.turn_id.clone(),
            tool_call: record.to_wit(),
            idempotency_key: idempotency_key(ctx.flow_id(), &record.turn_id, &id),
            attempt: ctx.attempt(),
        };
        let events = StepEvents::start(
            &ctx,
            self.options.events_capacity,
            HashSet::from([id.clone()]),
        );
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
            // A call keeps at most its share of the turn's output budget.
            let output_limit = record.output_limit;
            let keep = |text: String| match output_limit {
                Some(limit) => cut(
                    &text,
                    usize::try_from(limit).unwrap_or(usize::MAX),
                    "the turn's tool outputs are over their budget",
                ),
                None => text,
            };
            match result {
                Ok(Ok(output)) => {
                    record.status = ToolCallStatus::Succeeded;
                    record.output = Some(keep(output));
                }
                Ok(Err(ToolError::Execution(message))) => {
                    record.status = ToolCallStatus::Failed;
                    record.error = Some(keep(message));
                }
                Ok(Err(ToolError::Internal(message))) => {
                    return Err(retryable(format!(
                        "tool {} failed: {message}",
                        record.tool_name
                    )))
                }
                Err(err) if err.never_ran() => {
                    return Err(retryable(format!("{NOT_STARTED}{err}")))
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
        // A single attempt that provably never ran failed; a retried one
        // may have run in an earlier attempt, so its own rule stands.
        let never_ran = always_unknown && detail.starts_with(NOT_STARTED);
        record.status = if never_ran || (!always_unknown && record.effect == ToolEffect::Read) {
            ToolCallStatus::Failed
        } else {
            ToolCallStatus::OutcomeUnknown
        };
        // Within the call's share of the turn's output budget, like an output,
        // but never less than enough to say why.
        let limit = record
            .output_limit
            .map_or(ERROR_TEXT_BYTES, |l| {
                usize::try_from(l).unwrap_or(usize::MAX)
            })
            .clamp(ERROR_FLOOR_BYTES, ERROR_TEXT_BYTES);
        record.error = Some(cut(
            &format!("the tool call did not complete: {detail}"),
            limit,
            "the turn's tool outputs are over their budget",
        ));
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
}
