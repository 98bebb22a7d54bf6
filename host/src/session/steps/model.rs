//! RunModel: one `run-model-step` of the runner, and what its outcome
//! commits (the completed turn, or the deferred tool calls under the turn's
//! limits and the policies decided here).

use super::*;

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

impl SessionSteps {
    pub async fn run_model(self: Arc<Self>, ctx: StepContext) -> Result<StepResult, StepError> {
        let started = Instant::now();
        let components = self.components()?.clone();
        // Everything RunModel reads, in one round trip from one snapshot.
        // The messages are not among it: the runner reads the pages it
        // needs through the history handle.
        let mut answers = ctx
            .read_state(vec![
                StateQuery::get(AGENT_STATE, ""),
                newest_compaction_query(),
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
        let compactions: Vec<AgentCompaction> = entries_of(answers.next(), "compaction")?;
        let newest_compaction = compactions.into_iter().next();
        let run_state: Option<String> = value_of(answers.next(), "the run state")?;
        let mut records: Vec<AgentToolCall> = entries_of(answers.next(), "tool call record")?;
        records.sort_by_key(|r| r.deferral_order);
        let mut usage: AgentUsage =
            value_of(answers.next(), "the session usage")?.unwrap_or_default();
        // The turn's pinned runner, unless an activation moves turns in
        // flight (a forward fix): then the hop is recorded with the result.
        let mut hop = None;
        let digest = match state.runner_digest.clone() {
            Some(pinned) => match components
                .forward_fix(ctx.flow_id(), &pinned)
                .await
                .map_err(version_error)?
            {
                Some(to) => {
                    hop = Some(VersionChanged {
                        from: pinned,
                        to: to.to.clone(),
                        why: to.why,
                    });
                    to.to
                }
                None => pinned,
            },
            None => {
                components
                    .new_turn_runner(ctx.flow_id())
                    .await
                    .map_err(version_error)?
                    .digest
            }
        };
        ctx.record_component(&digest);
        let runner = components.runner(&digest).await.map_err(version_error)?;
        let tool_set = components
            .tool_set(ctx.flow_id())
            .await
            .map_err(version_error)?;
        let policies = self.policies_for(&tool_set);
        let history = Arc::new(StoredHistory::new(ctx.clone(), state.message_count));
        let turn_context = TurnInput {
            flow_id: ctx.flow_id().to_string(),
            turn_id: turn.clone(),
            attempt: ctx.attempt(),
            history: history.clone(),
            compaction: newest_compaction.as_ref().map(AgentCompaction::to_wit),
            framework_run_state: run_state,
            tool_calls: records.iter().map(AgentToolCall::to_wit).collect(),
            tools: tool_set.specs.clone(),
        };
        let context_bytes = turn_context.context_bytes();
        let before_guest = started.elapsed();
        let tag = Self::tag(&ctx, &turn);
        let managed = records.iter().map(|r| r.tool_call_id.clone()).collect();
        let events =
            StepEvents::start_holding_tool_events(&ctx, self.options.events_capacity, managed);
        let outcome = {
            let _beat = BackgroundHeartbeat::start(ctx.heartbeat_handle());
            let timeout = self.options.model_step_timeout;
            let mut env = self.env(&ctx, tag.clone(), &events, timeout, policies.clone());
            if let Some(model) = &components.model {
                env = env.with_model(model.clone());
            }
            runner.run_model_step(env, turn_context).await
        };
        let after_guest = Instant::now();
        // The calls the outcome defers are the host's to report.
        let deferred: HashSet<String> = match &outcome {
            Ok(Ok(TurnOutcome::ToolCallsRequested(request))) => request
                .tool_calls
                .iter()
                .map(|c| c.tool_call_id.clone())
                .collect(),
            _ => HashSet::new(),
        };
        let leftovers = events.finish_refusing(&deferred).await;
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
                TurnOutcome::Compacted(compacted) => &compacted.usage,
            });
            usage.add(&recorded);
            // Host time: before the guest ran, after it returned, and the
            // history pages it read while it ran.
            let host = before_guest + after_guest.elapsed();
            let usage_event = host_event(
                &tag,
                &UsageRecorded {
                    recorded,
                    session: usage,
                    context: history.meter.report(context_bytes, host.as_micros() as u64),
                },
            );
            let hop_writes = match hop {
                Some(hop) => StepResult::end().append(AGENT_EVENTS, host_event(&tag, &hop)),
                None => StepResult::end(),
            };
            match outcome {
                TurnOutcome::Compacted(compacted) => {
                    check_compaction(
                        compacted.through_sequence,
                        state.message_count,
                        newest_compaction.as_ref(),
                        &turn,
                    )
                    .map_err(|reason| {
                        fatal(format!(
                            "the runner's compacted outcome is invalid: {reason}"
                        ))
                    })?;
                    let compaction = AgentCompaction::from_wit(&turn, &compacted);
                    // The same turn goes on with the compaction in its
                    // context; its run state and records are untouched.
                    state.runner_digest = Some(digest.clone());
                    // Only the newest is ever read: the one it replaces goes.
                    let mut result =
                        StepResult::go_to(run_model_call()).with_writes(hop_writes.writes);
                    if let Some(replaced) = &newest_compaction {
                        result = result.delete(AGENT_COMPACTIONS, &replaced.key());
                    }
                    Ok(result
                        .set_entry(AGENT_COMPACTIONS, &compaction.key(), to_json(&compaction))
                        .set(AGENT_USAGE, to_json(&usage))
                        .set(AGENT_STATE, to_json(&state))
                        .append(AGENT_EVENTS, usage_event)
                        .append(
                            AGENT_EVENTS,
                            host_event(
                                &tag,
                                &HistoryCompacted {
                                    through_sequence: compaction.through_sequence,
                                },
                            ),
                        ))
                }
                TurnOutcome::Completed(done) => {
                    let limit = self.options.turn_limits.messages;
                    if done.new_messages.len() > limit as usize {
                        return Err(fatal(format!(
                            "the runner returned {} messages; a turn may add at most {limit}",
                            done.new_messages.len()
                        )));
                    }
                    let mut result =
                        StepResult::go_to(await_user_message_call()).with_writes(hop_writes.writes);
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
                    state.runner_digest = None;
                    state.end_turn_trace(&ctx, &turn, "completed");
                    Ok(result
                        .clear(AGENT_TOOL_CALLS)
                        .delete(FRAMEWORK_RUN_STATE, "")
                        .clear(PENDING_INTERRUPTS)
                        .set(AGENT_USAGE, to_json(&usage))
                        .set(AGENT_STATE, to_json(&state))
                        .append(AGENT_EVENTS, usage_event)
                        .append(
                            AGENT_EVENTS,
                            host_event(
                                &tag,
                                &TurnCompleted {
                                    message_count: count,
                                },
                            ),
                        ))
                }
                TurnOutcome::ToolCallsRequested(request) => {
                    check_tool_calls_requested(&request, &records).map_err(|reason| {
                        fatal(format!(
                            "the runner's tool-calls-requested is invalid: {reason}"
                        ))
                    })?;
                    let limits = self.options.turn_limits;
                    let total = records.len() + request.tool_calls.len();
                    if total > limits.tool_calls as usize {
                        return Err(fatal(format!(
                            "the runner asked for {} tool calls ({total} in this turn); a turn may \
                             defer at most {}",
                            request.tool_calls.len(),
                            limits.tool_calls
                        )));
                    }
                    // What the earlier calls of the turn keep counts against
                    // the turn's budget; the new calls share the rest.
                    let used: u64 = records
                        .iter()
                        .map(|r| {
                            r.output.as_deref().map_or(0, str::len) as u64
                                + r.error.as_deref().map_or(0, str::len) as u64
                        })
                        .sum();
                    let share = output_share(&limits, used, request.tool_calls.len());
                    let now = ctx.now().await?;
                    let deadline = self.options.interrupt_deadline.map(|after| {
                        let after = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
                        now.saturating_add(after)
                    });
                    let mut next = Vec::with_capacity(request.tool_calls.len() + 1);
                    let mut result = hop_writes
                        .set(FRAMEWORK_RUN_STATE, json!(request.framework_run_state))
                        .set(AGENT_USAGE, to_json(&usage))
                        .append(AGENT_EVENTS, usage_event);
                    for (index, call) in request.tool_calls.iter().enumerate() {
                        // Decided once, by the rules the runner's import
                        // answers with; the runner may only add caution.
                        let decided = policies.decide(&call.tool_name, call.policy);
                        // Pinned now: the tool version active at deferral
                        // runs every attempt, or the turn's runner.
                        let (component, pinned) = match tool_set.serving(&call.tool_name) {
                            Some(tool) => (Some(tool.role.clone()), tool.digest.clone()),
                            None => (None, digest.clone()),
                        };
                        let effect: ToolEffect = decided.effect.into();
                        let requires_approval = decided.requires_approval;
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
                            output_limit: Some(share),
                            component,
                            digest: Some(pinned),
                        };
                        result = result
                            .set_entry(AGENT_TOOL_CALLS, &record.tool_call_id, to_json(&record))
                            .append(
                                AGENT_EVENTS,
                                host_event(
                                    &tag,
                                    &ToolCallDeferred {
                                        tool_call_id: record.tool_call_id.clone(),
                                        tool_name: record.tool_name.clone(),
                                        effect,
                                        requires_approval,
                                        component: record.component.clone(),
                                        digest: record.digest.clone(),
                                    },
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
                                .set_entry(
                                    RAISED_INTERRUPTS,
                                    &interrupt.interrupt_id,
                                    json!({"turn_id": interrupt.turn_id}),
                                )
                                .append(
                                    AGENT_EVENTS,
                                    host_event(
                                        &tag,
                                        &InterruptRaised {
                                            interrupt_id: interrupt.interrupt_id.clone(),
                                            tool_call_id: interrupt.tool_call_id.clone(),
                                            tool_name: interrupt.tool_name.clone(),
                                            deadline,
                                        },
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
                    state.runner_digest = Some(digest.clone());
                    Ok(StepResult::go_to_many(next)
                        .with_writes(result.writes)
                        .set(AGENT_STATE, to_json(&state)))
                }
            }
        }
        .await;
        settle(&ctx, leftovers, result).await
    }
}
