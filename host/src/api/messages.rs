//! `/v1/sessions/{id}/messages`: queue a user message (and, with `?wait=`,
//! wait for the turn it starts; with `interrupt`, steer), list the
//! session's messages; and `/v1/sessions/{id}/turn/cancel`.

use std::time::Duration;

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use schemars::JsonSchema;
use serde::Deserialize;

use super::answers::{SendAnswer, TurnCancel};
use super::{body, idempotency_key, query, ApiError, ApiState};
use crate::session::{
    AgentMessagesPage, CancelOutcome, ListAgentMessagesRequest, SendOutcome, MAX_TURN_WAIT,
    MAX_USER_MESSAGE_BYTES,
};
use crate::telemetry::traces::TurnTrace;

/// `POST /v1/sessions/{id}/messages`'s body.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "SendMessage")]
pub(super) struct SendMessageBody {
    #[schemars(
        length(min = 1),
        regex(pattern = r"\S"),
        description = format!("At most {MAX_USER_MESSAGE_BYTES} bytes of UTF-8; a blank text is a 400 and nothing is queued")
    )]
    text: String,
    /// Steer: cancel the running turn (as /turn/cancel does) and start the
    /// next turn with this message, ahead of the queue; with no turn running
    /// it is queued as usual.
    #[serde(default)]
    interrupt: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SendQuery {
    /// Wait up to this many seconds for the turn the message starts.
    #[serde(default)]
    wait: Option<f64>,
}

/// The `?wait=` duration: 0 to [`MAX_TURN_WAIT`] seconds.
fn wait_duration(wait: f64) -> Result<Duration, ApiError> {
    let max = MAX_TURN_WAIT.as_secs_f64();
    if !wait.is_finite() || !(0.0..=max).contains(&wait) {
        return Err(ApiError::bad_request(format!(
            "wait must be a number of seconds from 0 to {max}; nothing was queued"
        )));
    }
    Ok(Duration::from_secs_f64(wait))
}

/// Queues a user message. With an `Idempotency-Key` header, at most once per
/// key and session: a retry with the same key and text queues nothing and
/// gets the first answer, marked `"replayed": true`; the same key with
/// another text is a 422 `idempotency_key_reused`. The session remembers a
/// key for at least 24 h (its 1000 newest keys at most).
///
/// With `?wait=SECONDS` (up to 300) the answer waits for the turn the
/// message starts: 200 with the turn's new messages and usage when it
/// completes (or its error when it fails), 202 with the turn id when it
/// needs an approval or the wait runs out. A client that goes away does not
/// cancel the turn. A replayed send waits for the first send's turn, from
/// where the first send saw the session's events end.
pub(super) async fn send_message(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
    params: Result<Query<SendQuery>, QueryRejection>,
    payload: Result<Json<SendMessageBody>, JsonRejection>,
) -> Result<(StatusCode, Json<SendAnswer>), ApiError> {
    let key = idempotency_key(&headers)?;
    let wait = query(params)?.wait.map(wait_duration).transpose()?;
    let request = body(payload)?;
    let (sessions, _) = state.session(&session_id).await?;
    // Where the session's events stand before the send: the turn the
    // message starts comes after. Read for a keyed send too, and remembered
    // with the key, so that a retry that waits starts there (not at the
    // oldest event kept: a cheap request must not read the whole stream).
    let head = match (wait, &key) {
        (None, None) => None,
        _ => Some(sessions.event_head(&session_id).await?),
    };
    let sent = sessions
        .send_traced(
            &session_id,
            &request.text,
            key.as_deref(),
            request.interrupt,
            TurnTrace::from_headers(&headers),
            head,
        )
        .await?;
    if sent.outcome == SendOutcome::Blank {
        return Err(ApiError::bad_request("text is blank; nothing was queued"));
    }
    let answer = SendAnswer {
        queued: true,
        replayed: key.as_ref().map(|_| sent.outcome == SendOutcome::Replayed),
        idempotency_key: key,
        message_id: sent.message_id.clone(),
        interrupted: request.interrupt.then(|| sent.interrupted.clone()),
        ..SendAnswer::default()
    };
    let (Some(wait), Some(head), Some(message_id)) = (wait, head, sent.message_id) else {
        return Ok((StatusCode::ACCEPTED, Json(answer)));
    };
    // A replay's turn may have started before this request: it is looked
    // for after where the first send stood (from the oldest event kept for
    // a key recorded before dexa remembered that).
    let after = match sent.outcome {
        SendOutcome::Replayed => sent.events_after.unwrap_or(0),
        _ => head,
    };
    let waited = sessions
        .wait_for_turn(&session_id, &message_id, after, wait)
        .await?;
    let status = if waited.is_final() {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, Json(answer.waited(waited))))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CancelQuery {
    /// Cancel only if this turn is the one running.
    #[serde(default)]
    turn_id: Option<String>,
}

/// Cancels the running turn (see [`AgentSessionClient::cancel_turn`]):
/// `{"cancelled": true, "turn_id"}`, or `{"cancelled": false}` when no turn
/// runs. With `?turn_id=`, only that turn: another one running is left
/// alone (`{"cancelled": false, "running_turn_id"}`).
///
/// [`AgentSessionClient::cancel_turn`]: crate::session::AgentSessionClient::cancel_turn
pub(super) async fn cancel_turn(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
    params: Result<Query<CancelQuery>, QueryRejection>,
) -> Result<Json<TurnCancel>, ApiError> {
    let named = query(params)?.turn_id;
    if named.as_deref().is_some_and(str::is_empty) {
        return Err(ApiError::bad_request(
            "turn_id names no turn; leave it out to cancel whichever turn runs",
        ));
    }
    let (sessions, _) = state.session(&session_id).await?;
    let outcome = match &named {
        Some(turn_id) => sessions.cancel_named_turn(&session_id, turn_id).await?,
        None => sessions.cancel_turn(&session_id).await?,
    };
    Ok(Json(match outcome {
        CancelOutcome::Cancelled { turn_id } => TurnCancel {
            cancelled: true,
            turn_id: Some(turn_id),
            running_turn_id: None,
        },
        CancelOutcome::NoTurn => TurnCancel {
            cancelled: false,
            turn_id: None,
            running_turn_id: None,
        },
        CancelOutcome::NotThatTurn { running } => TurnCancel {
            cancelled: false,
            turn_id: None,
            running_turn_id: Some(running),
        },
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MessagesQuery {
    #[serde(default)]
    after_sequence: Option<u64>,
    /// Clamped to 1..=200, as the spec says.
    #[serde(default)]
    limit: Option<i64>,
}

pub(super) async fn list_messages(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
    params: Result<Query<MessagesQuery>, QueryRejection>,
) -> Result<Json<AgentMessagesPage>, ApiError> {
    let params = query(params)?;
    let (sessions, _) = state.session(&session_id).await?;
    let page = sessions
        .list_agent_messages(
            &session_id,
            ListAgentMessagesRequest {
                after_sequence: params.after_sequence,
                // Clamped here to the u32 the request takes; the client
                // clamps it to its page size.
                limit: params.limit.unwrap_or(50).clamp(1, i64::from(u32::MAX)) as u32,
            },
        )
        .await?;
    Ok(Json(page))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_outside_zero_to_five_minutes_is_refused() {
        assert!(wait_duration(0.0).is_ok());
        assert_eq!(wait_duration(2.5).ok(), Some(Duration::from_millis(2500)));
        assert!(wait_duration(300.0).is_ok());
        for bad in [-1.0, 300.5, f64::NAN, f64::INFINITY] {
            assert!(wait_duration(bad).is_err(), "{bad}");
        }
    }
}
