//! The tool Steps: AwaitToolApproval, CallTool and CallSingleAttemptTool,
//! their failure routes, and ResumeTurn.

use super::*;

/// The least of a failure's reason a record keeps, whatever its share.
const ERROR_FLOOR_BYTES: usize = 256;

/// What runs a tool call: its tool component, or the turn's runner.
enum Target {
    Tool(Arc<ToolComponent>),
    Runner(Arc<RunnerComponent>),
}

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
            host_event(
                &tag,
                &InterruptResolved {
                    interrupt_id: interrupt.clone(),
                    approved,
                    rejection_message: rejection.clone(),
                    expired,
                },
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
        // The version the call was pinned to when it was deferred; a call
        // stored before pins were kept takes what its turn would offer now.
        let target = match (&record.component, &record.digest) {
            (Some(role), Some(digest)) => components
                .tool(role, digest)
                .await
                .map(|tool| (digest.clone(), Target::Tool(tool))),
            (None, Some(digest)) => components
                .runner(digest)
                .await
                .map(|runner| (digest.clone(), Target::Runner(runner))),
            (_, None) => self.unpinned_target(&ctx, &record.tool_name).await,
        };
        let (digest, target) = target.map_err(|err| {
            // A version it cannot have never started the call.
            let err = version_error(err);
            match err {
                StepError::Fatal(message) => StepError::Fatal(format!("{NOT_STARTED}{message}")),
                StepError::Retryable(message) => {
                    StepError::Retryable(format!("{NOT_STARTED}{message}"))
                }
            }
        })?;
        ctx.record_component(&digest);
        // Durable output before the tool runs: a lost worker now means the
        // next attempt (or the failure route), never a silent second run.
        let started = host_event(
            &tag,
            &ToolCallStarted {
                tool_call_id: id.clone(),
                tool_name: record.tool_name.clone(),
            },
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
            let policies = self.session_policies(&ctx).await;
            let env = self.env(
                &ctx,
                tag.clone(),
                &events,
                self.options.tool_attempt_timeout,
                policies,
            );
            match target {
                Target::Tool(tool) => tool.call(env, &execution).await,
                Target::Runner(runner) => runner.execute_deferred_tool_call(env, &execution).await,
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
                Err(err @ CallError::Trapped { by_guest: true, .. }) => {
                    return Err(retryable(format!("{CRASHED}{err}")))
                }
                // A host call refused what the guest passed (or the guest
                // exited): the host wrote `reason`, which the model may
                // read; what the guest wrote to stderr is in its guest_log
                // event and the `dexa::guest` log line only.
                Err(CallError::Trapped {
                    component,
                    export,
                    reason,
                    by_guest: false,
                    ..
                }) => {
                    return Err(retryable(format!(
                        "component `{component}`: `{export}` failed: {reason}"
                    )));
                }
                Err(err) => return Err(retryable(err.to_string())),
            }
            Ok(finalize(&tag, &record, StepResult::end()))
        }
        .await;
        settle(&ctx, leftovers, result).await
    }

    /// Where a call with no pin runs: the tool component serving it in the
    /// session's tool set now, else the turn's runner.
    async fn unpinned_target(
        &self,
        ctx: &StepContext,
        tool_name: &str,
    ) -> Result<(String, Target), VersionError> {
        let components = self
            .components()
            .map_err(|err| VersionError::Missing(err.to_string()))?;
        let set = components.tool_set(ctx.flow_id()).await?;
        if let Some(tool) = set.serving(tool_name) {
            return Ok((tool.digest.clone(), Target::Tool(tool.component.clone())));
        }
        let state = Self::state(ctx)
            .await
            .map_err(|err| VersionError::Unavailable(err.to_string()))?;
        let pinned = self.turn_runner(ctx, &state).await?;
        Ok((pinned.digest, Target::Runner(pinned.runner)))
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
        // What the model reads: a trap's text stays in the history.
        let shown = if detail.starts_with(CRASHED) {
            "the tool crashed (its error is in the session's Step history)"
        } else {
            detail
        };
        record.error = Some(cut(
            &format!("the tool call did not complete: {shown}"),
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
