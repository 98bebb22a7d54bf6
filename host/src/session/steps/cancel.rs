//! CancelTurn: ends a turn a client cancelled (or steered away from).
//!
//! The cancel RPC took every task of the session in one transaction (a
//! running Step's commit is refused from then on, and its worker stops it)
//! and left this Step with what each task was. It records the turn's
//! unfinished tool calls `cancelled`, except a single-attempt call that had
//! started, which is `outcome_unknown` (it may have acted); writes a note in
//! the history, built like the turn-failure note, so that the next turn
//! knows which tools ran; and ends the turn with `turn_cancelled`. Queued
//! user messages stay queued; a steering message starts the next turn.

use serde::Deserialize;

use super::turn::tool_call_note;
use super::*;
use crate::flow::TakenTask;

/// What a Step of the cancelled turn was when the cancel took it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TakenStep {
    pub step_type: String,
    pub input: Json,
    /// The attempt recorded output: a single-attempt tool call had started.
    pub output_recorded: bool,
    /// Its attempt (an attempt after the first means an earlier one ran).
    #[serde(default = "first_attempt")]
    pub attempt: u32,
    /// For a failure route: why the Step failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

fn first_attempt() -> u32 {
    1
}

impl From<TakenTask> for TakenStep {
    fn from(task: TakenTask) -> Self {
        Self {
            step_type: task.step_type,
            input: task.input,
            output_recorded: task.output_recorded,
            attempt: task.attempt,
            failure: task.failure,
        }
    }
}

/// CancelTurn's input.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CancelTurnInput {
    pub turn_id: String,
    /// The turn's Steps the cancel took, oldest first.
    pub taken: Vec<TakenStep>,
    /// Messages sent with `interrupt`: the first starts the next turn, the
    /// rest are queued after it.
    #[serde(default)]
    pub steer: Vec<AgentUserMessage>,
}

impl CancelTurnInput {
    /// The tool calls that had started (any attempt): a single-attempt one
    /// is then of unknown outcome, one that may run again is still
    /// `cancelled`, but its record says it may have run.
    fn started(&self) -> HashSet<String> {
        self.taken
            .iter()
            .filter(|step| match step.step_type.as_str() {
                step::CALL_SINGLE_ATTEMPT_TOOL => step.output_recorded,
                step::CALL_TOOL => step.output_recorded || step.attempt > 1,
                step::RECORD_TOOL_OUTCOME_UNKNOWN | step::RECORD_TOOL_FAILURE => !step
                    .failure
                    .as_deref()
                    .is_some_and(|why| why.starts_with(NOT_STARTED)),
                _ => false,
            })
            .filter_map(|step| step.input.as_str().map(str::to_string))
            .collect()
    }
}

/// The note a cancelled turn leaves in the history.
pub fn turn_cancelled_note(records: &[AgentToolCall]) -> String {
    if records.is_empty() {
        return "[Dex] The user cancelled the previous turn before it finished; no tool ran."
            .to_string();
    }
    tool_call_note(
        "[Dex] The user cancelled the previous turn. Its tool calls:\n",
        records,
    )
}

impl SessionSteps {
    pub async fn cancel_turn(self: Arc<Self>, ctx: StepContext) -> Result<StepResult, StepError> {
        let input: CancelTurnInput = decode("CancelTurn's input", ctx.input().clone())?;
        let mut state = Self::state(&ctx).await?;
        let mut steer = input.steer.clone().into_iter();
        if state.active_turn_id.as_deref() != Some(input.turn_id.as_str()) {
            // The turn ended before the cancel took its Steps (it cannot,
            // the cancel checks in the same transaction; but no message may
            // be lost if it did): steering messages wait in the queue.
            let mut result =
                StepResult::go_to(await_user_message_call()).delete(CANCEL_REQUESTED, "");
            for message in steer {
                result = result.publish(QUEUED_USER_MESSAGES, "", to_json(&message));
            }
            return Ok(result);
        }
        let turn = input.turn_id.clone();
        let tag = Self::tag(&ctx, &turn);
        let started = input.started();
        let mut result = StepResult::end();
        let mut records = Self::records(&ctx).await?;
        let (mut cancelled, mut unknown) = (0u32, 0u32);
        for record in records.iter_mut().filter(|r| !r.status.is_final()) {
            if !record.effect.may_repeat() && started.contains(&record.tool_call_id) {
                record.status = ToolCallStatus::OutcomeUnknown;
                record.error = Some(
                    "the turn was cancelled while this call ran; it may have taken effect"
                        .to_string(),
                );
                unknown += 1;
            } else {
                record.status = ToolCallStatus::Cancelled;
                record.error = Some(if started.contains(&record.tool_call_id) {
                    "the turn was cancelled while this call ran; it may have run (it is safe \
                     to repeat)"
                        .to_string()
                } else {
                    "the turn was cancelled before this call finished".to_string()
                });
                cancelled += 1;
            }
            result = result.append(
                AGENT_EVENTS,
                host_event(
                    &tag,
                    &ToolCallFinished {
                        tool_call_id: record.tool_call_id.clone(),
                        tool_name: record.tool_name.clone(),
                        status: record.status.as_str().to_string(),
                    },
                ),
            );
        }
        // The note is the turn's own: its pinned runner builds it; on the
        // last attempt the turn ends without it, and says why.
        let (result, note_error) = self
            .add_turn_note(
                &ctx,
                &tag,
                &mut state,
                &turn_cancelled_note(&records),
                result,
            )
            .await?;
        state.status = SessionStatus::WaitingForUserMessage;
        state.active_turn_id = None;
        state.last_turn_error = None;
        state.runner_digest = None;
        state.end_turn_trace(&ctx, &turn, "cancelled");
        let result = result
            .clear(AGENT_TOOL_CALLS)
            .delete(FRAMEWORK_RUN_STATE, "")
            .clear(PENDING_INTERRUPTS)
            .delete(CANCEL_REQUESTED, "")
            .append(
                AGENT_EVENTS,
                host_event(
                    &tag,
                    &TurnCancelled {
                        cancelled_tool_calls: cancelled,
                        outcome_unknown_tool_calls: unknown,
                        steered: !input.steer.is_empty(),
                        note_error,
                    },
                ),
            );
        let Some(first) = steer.next() else {
            return Ok(StepResult::go_to(await_user_message_call())
                .with_writes(result.writes)
                .set(AGENT_STATE, to_json(&state)));
        };
        let mut result = result;
        for later in steer {
            result = result.publish(QUEUED_USER_MESSAGES, "", to_json(&later));
        }
        self.begin_turn(&ctx, state, &first, result).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taken(step_type: &str, id: &str, output_recorded: bool, failure: Option<&str>) -> TakenStep {
        TakenStep {
            step_type: step_type.to_string(),
            input: json!(id),
            output_recorded,
            attempt: 1,
            failure: failure.map(str::to_string),
        }
    }

    #[test]
    fn only_a_single_attempt_call_that_started_is_of_unknown_outcome() {
        let input = CancelTurnInput {
            turn_id: "turn-1".into(),
            taken: vec![
                taken(step::CALL_SINGLE_ATTEMPT_TOOL, "ran", true, None),
                taken(step::CALL_SINGLE_ATTEMPT_TOOL, "claimed", false, None),
                taken(step::CALL_TOOL, "retried", true, None),
                taken(step::CALL_TOOL, "waiting", false, None),
                taken(
                    step::RECORD_TOOL_OUTCOME_UNKNOWN,
                    "failed-after-start",
                    false,
                    Some("trap"),
                ),
                taken(
                    step::RECORD_TOOL_OUTCOME_UNKNOWN,
                    "never-started",
                    false,
                    Some(&format!("{NOT_STARTED}no sandbox")),
                ),
            ],
            steer: Vec::new(),
        };
        let started = input.started();
        let mut started: Vec<&str> = started.iter().map(String::as_str).collect();
        started.sort();
        assert_eq!(started, vec!["failed-after-start", "ran", "retried"]);
    }

    #[test]
    fn a_cancel_with_no_tool_calls_still_leaves_a_note() {
        let note = turn_cancelled_note(&[]);
        assert!(note.contains("cancelled the previous turn"), "{note}");
    }
}
