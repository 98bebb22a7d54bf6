//! Cancelling a running turn, and steering (a message that cancels the
//! running turn and starts the next one): the RPC side.
//!
//! One transaction takes every task of the session (a running Step's commit
//! and heartbeats are refused from then on, and its worker, woken by the
//! store's revocation signal at the commit, stops it after one look at its
//! lease), appends `turn_cancel_requested` for the session's clients and
//! leaves one CancelTurn Step with what each was (see
//! `steps/cancel.rs`). A cancel while another is still pending merges
//! into it, so that no steering message is lost.

use super::client::{AgentSessionClient, SessionError};
use super::event_data::TurnCancelRequested;
use super::records::*;
use super::steps::{step, CancelTurnInput, TakenStep};
use crate::flow::{FlowStatus, MapQuery, Registry, RpcError, StateTx, StepCall, StoreError};

/// What a cancel did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The turn's Steps were taken; `turn_cancelled` follows.
    Cancelled { turn_id: String },
    /// No turn was running.
    NoTurn,
    /// The turn named was not the one running (it had ended): nothing was
    /// cancelled. `running` is the turn that runs now.
    NotThatTurn { running: String },
}

/// What a cancel finds: the running turn, or why it cancels nothing.
fn target(
    tx: &mut dyn StateTx,
    named: Option<&str>,
) -> Result<Result<String, CancelOutcome>, RpcError> {
    Ok(match (active_turn(tx)?, named) {
        (None, _) => Err(CancelOutcome::NoTurn),
        (Some(running), Some(named)) if running != named => {
            Err(CancelOutcome::NotThatTurn { running })
        }
        (Some(running), _) => Ok(running),
    })
}

fn corrupt(what: &str, err: serde_json::Error) -> RpcError {
    RpcError::Store(StoreError::Corrupt(format!("{what}: {err}")))
}

/// Whether session `id` exists and runs: a cancel needs both.
pub(super) fn running(
    tx: &mut dyn StateTx,
    id: &str,
) -> Result<Result<(), SessionError>, RpcError> {
    let Some(flow) = tx.flow()? else {
        return Ok(Err(SessionError::NoSuchSession(id.to_string())));
    };
    if flow.status != FlowStatus::Running {
        return Ok(Err(SessionError::NotRunning {
            session_id: id.to_string(),
            status: flow.status.as_str().to_string(),
        }));
    }
    Ok(Ok(()))
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

/// Why [`take_turn`] refused.
pub(super) enum TakeRefused {
    SteersPending { turn_id: String },
}

impl TakeRefused {
    pub(super) fn for_session(self, session_id: &str) -> SessionError {
        match self {
            TakeRefused::SteersPending { turn_id } => SessionError::SteersPending {
                session_id: session_id.to_string(),
                turn_id,
            },
        }
    }
}

/// The [`CANCEL_REQUESTED`] marker: the turn, and how many steering
/// messages wait for its CancelTurn.
#[derive(serde::Serialize, serde::Deserialize)]
struct CancelRequested {
    turn_id: String,
    steers: usize,
}

/// The steering messages waiting for `turn_id`'s cancel, when one is under
/// way (its CancelTurn has not committed).
fn cancel_pending(tx: &mut dyn StateTx, turn_id: &str) -> Result<Option<usize>, RpcError> {
    let Some(marker) = tx.get(CANCEL_REQUESTED, "")? else {
        return Ok(None);
    };
    let marker: CancelRequested =
        serde_json::from_value(marker.value).map_err(|err| corrupt("the cancel marker", err))?;
    Ok((marker.turn_id == turn_id).then_some(marker.steers))
}

/// Takes `turn_id`'s Steps and leaves CancelTurn in their place, with
/// `steer` (if any) to start the next turn.
///
/// A cancel already under way is left alone by a plain cancel (nothing is
/// written). A steer joins it, taking its CancelTurn even while one runs (a
/// CancelTurn keeps every effect for its commit, so its worker stops it and
/// the new one does it all again); at most [`MAX_PENDING_STEERS`] join, so
/// that no flood of steers keeps the turn from ending.
pub(super) fn take_turn(
    tx: &mut dyn StateTx,
    registry: &Registry,
    turn_id: &str,
    steer: Option<AgentUserMessage>,
) -> Result<Result<(), TakeRefused>, RpcError> {
    let pending = cancel_pending(tx, turn_id)?;
    let steers = match (pending, &steer) {
        (Some(_), None) => return Ok(Ok(())),
        // Refused before anything is written.
        (Some(waiting), Some(_)) if waiting >= MAX_PENDING_STEERS => {
            return Ok(Err(TakeRefused::SteersPending {
                turn_id: turn_id.to_string(),
            }))
        }
        (waiting, _) => waiting.unwrap_or(0) + usize::from(steer.is_some()),
    };
    let flow = tx
        .flow()?
        .ok_or_else(|| RpcError::Rejected("the session is gone".to_string()))?;
    // The event first: a running Step's "started" marker locks the stream
    // before its task, and so does this transaction.
    let event = AgentEvent {
        event_type: event_type::TURN_CANCEL_REQUESTED.to_string(),
        turn_id: turn_id.to_string(),
        step_execution_id: String::new(),
        attempt: 0,
        origin: None,
        data: serde_json::to_value(TurnCancelRequested {
            steered: steer.is_some(),
        })
        .map_err(|err| corrupt("an event", err))?,
    };
    tx.append(
        AGENT_EVENTS,
        serde_json::to_value(event).map_err(|err| corrupt("an event", err))?,
    )?;
    let mut input = CancelTurnInput {
        turn_id: turn_id.to_string(),
        taken: Vec::new(),
        steer: Vec::new(),
    };
    for task in tx.take_tasks()? {
        // The cancel under way: this steer joins it.
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
    // The turn's approvals end with it now: one answered before CancelTurn
    // commits would otherwise report a resolution that nothing reads.
    for (key, _) in tx.read_map(PENDING_INTERRUPTS, &MapQuery::default())? {
        tx.delete(PENDING_INTERRUPTS, &key)?;
    }
    let call = StepCall::new(
        step::CANCEL_TURN,
        serde_json::to_value(&input).map_err(|err| corrupt("CancelTurn's input", err))?,
    );
    let task = registry
        .new_task(&flow.flow_type, call, tx.now(), None)
        .map_err(|err| RpcError::Rejected(err.to_string()))?;
    tx.add_task(task)?;
    let marker = CancelRequested {
        turn_id: turn_id.to_string(),
        steers,
    };
    tx.set(
        CANCEL_REQUESTED,
        "",
        serde_json::to_value(marker).map_err(|err| corrupt("the cancel marker", err))?,
    )?;
    Ok(Ok(()))
}

impl AgentSessionClient {
    /// Cancels the running turn: its guest calls are stopped on whichever
    /// worker runs them, its unfinished tool calls are recorded `cancelled`
    /// (a single-attempt call that had started, `outcome_unknown`), a note
    /// goes into the history and `turn_cancelled` ends it. Queued messages
    /// stay queued. [`CancelOutcome::NoTurn`] when no turn runs.
    pub async fn cancel_turn(&self, session_id: &str) -> Result<CancelOutcome, SessionError> {
        self.cancel(session_id, None).await
    }

    /// [`Self::cancel_turn`], only if the running turn is `turn_id`: a
    /// cancel sent late (a retry, a click on a stale page) must not cancel
    /// the turn after the one it meant, which would use up a queued
    /// message. [`CancelOutcome::NotThatTurn`] otherwise.
    pub async fn cancel_named_turn(
        &self,
        session_id: &str,
        turn_id: &str,
    ) -> Result<CancelOutcome, SessionError> {
        self.cancel(session_id, Some(turn_id)).await
    }

    async fn cancel(
        &self,
        session_id: &str,
        named: Option<&str>,
    ) -> Result<CancelOutcome, SessionError> {
        // Most repeated cancels (a user pressing again) need no write.
        if let Some(settled) = self.cancel_settled(session_id, named).await? {
            return Ok(settled);
        }
        let registry = self.flow_client().registry().clone();
        let id = session_id.to_string();
        let named = named.map(str::to_string);
        self.flow_client()
            .rpc(session_id, move |tx| {
                if let Err(err) = running(tx, &id)? {
                    return Ok(Err(err));
                }
                let turn_id = match target(tx, named.as_deref())? {
                    Ok(turn_id) => turn_id,
                    Err(outcome) => return Ok(Ok(outcome)),
                };
                if let Err(err) = take_turn(tx, &registry, &turn_id, None)? {
                    return Ok(Err(err.for_session(&id)));
                }
                Ok(Ok(CancelOutcome::Cancelled { turn_id }))
            })
            .await?
    }

    /// What a cancel would do, from a read-only snapshot: `Some` when it
    /// needs no write (no turn runs, or its cancel is under way).
    async fn cancel_settled(
        &self,
        session_id: &str,
        named: Option<&str>,
    ) -> Result<Option<CancelOutcome>, SessionError> {
        let id = session_id.to_string();
        let named = named.map(str::to_string);
        self.flow_client()
            .read_rpc(session_id, move |tx| {
                if let Err(err) = running(tx, &id)? {
                    return Ok(Err(err));
                }
                Ok(Ok(match target(tx, named.as_deref())? {
                    Err(outcome) => Some(outcome),
                    Ok(turn_id) if cancel_pending(tx, &turn_id)?.is_some() => {
                        Some(CancelOutcome::Cancelled { turn_id })
                    }
                    Ok(_) => None,
                }))
            })
            .await?
    }
}
