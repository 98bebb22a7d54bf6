//! Cancelling a running turn, and steering (a message that cancels the
//! running turn and starts the next one): the RPC side.
//!
//! One transaction takes every task of the session (a running Step's commit
//! and heartbeats are refused from then on, and its worker, woken by the
//! `turn_cancel_requested` event appended in the same transaction, stops
//! it within [`crate::flow::MIN_LOOK_GAP`] plus a look at its lease) and
//! leaves one CancelTurn Step with what each was (see
//! `steps/cancel.rs`). A cancel while another is still pending merges
//! into it, so that no steering message is lost.

use serde_json::json;

use super::client::{AgentSessionClient, SessionError};
use super::records::*;
use super::steps::{step, CancelTurnInput, TakenStep};
use crate::flow::{FlowStatus, Registry, RpcError, StateTx, StepCall, StoreError};

/// What a cancel did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The turn's Steps were taken; `turn_cancelled` follows.
    Cancelled { turn_id: String },
    /// No turn was running.
    NoTurn,
}

fn corrupt(what: &str, err: serde_json::Error) -> RpcError {
    RpcError::Store(StoreError::Corrupt(format!("{what}: {err}")))
}

/// The running turn, if any.
pub(super) fn active_turn(tx: &mut dyn StateTx) -> Result<Option<String>, RpcError> {
    let Some(state) = tx.get(AGENT_STATE, "")? else {
        return Ok(None);
    };
    let state: AgentState =
        serde_json::from_value(state.value).map_err(|err| corrupt("the session state", err))?;
    Ok(state.active_turn_id)
}

/// Takes `turn_id`'s Steps and leaves CancelTurn in their place, with
/// `steer` (if any) to start the next turn.
pub(super) fn take_turn(
    tx: &mut dyn StateTx,
    registry: &Registry,
    turn_id: &str,
    steer: Option<AgentUserMessage>,
) -> Result<(), RpcError> {
    let flow = tx
        .flow()?
        .ok_or_else(|| RpcError::Rejected("the session is gone".to_string()))?;
    let mut input = CancelTurnInput {
        turn_id: turn_id.to_string(),
        taken: Vec::new(),
        steer: Vec::new(),
    };
    for task in tx.take_tasks()? {
        // A cancel still pending: this one joins it.
        if task.step_type == step::CANCEL_TURN {
            let pending: CancelTurnInput = serde_json::from_value(task.input)
                .map_err(|err| corrupt("a pending CancelTurn's input", err))?;
            input.taken.extend(pending.taken);
            input.steer.extend(pending.steer);
        } else {
            input.taken.push(TakenStep::from(task));
        }
    }
    input.steer.extend(steer);
    let steered = !input.steer.is_empty();
    let call = StepCall::new(
        step::CANCEL_TURN,
        serde_json::to_value(&input).map_err(|err| corrupt("CancelTurn's input", err))?,
    );
    let task = registry
        .new_task(&flow.flow_type, call, tx.now(), None)
        .map_err(|err| RpcError::Rejected(err.to_string()))?;
    tx.add_task(task)?;
    let event = AgentEvent {
        event_type: event_type::TURN_CANCEL_REQUESTED.to_string(),
        turn_id: turn_id.to_string(),
        step_execution_id: String::new(),
        attempt: 0,
        origin: None,
        data: json!({ "steered": steered }),
    };
    tx.append(
        AGENT_EVENTS,
        serde_json::to_value(event).map_err(|err| corrupt("an event", err))?,
    )?;
    Ok(())
}

impl AgentSessionClient {
    /// Cancels the running turn: its guest calls are stopped on whichever
    /// worker runs them, its unfinished tool calls are recorded `cancelled`
    /// (a single-attempt call that had started, `outcome_unknown`), a note
    /// goes into the history and `turn_cancelled` ends it. Queued messages
    /// stay queued. [`CancelOutcome::NoTurn`] when no turn runs.
    pub async fn cancel_turn(&self, session_id: &str) -> Result<CancelOutcome, SessionError> {
        let registry = self.flow_client().registry().clone();
        let id = session_id.to_string();
        self.flow_client()
            .rpc(session_id, move |tx| {
                let Some(flow) = tx.flow()? else {
                    return Ok(Err(SessionError::NoSuchSession(id.clone())));
                };
                if flow.status != FlowStatus::Running {
                    return Ok(Err(SessionError::NotRunning {
                        session_id: id.clone(),
                        status: flow.status.as_str().to_string(),
                    }));
                }
                let Some(turn_id) = active_turn(tx)? else {
                    return Ok(Ok(CancelOutcome::NoTurn));
                };
                take_turn(tx, &registry, &turn_id, None)?;
                Ok(Ok(CancelOutcome::Cancelled { turn_id }))
            })
            .await?
    }
}
