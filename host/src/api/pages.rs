//! The listings that grow without end, paged by cursor: `GET /v1/sessions`
//! (newest first; `cursor` is the `next_cursor` of the page before) and
//! `GET /v1/sessions/{id}/history` (oldest first; `after` is the
//! `next_after` of the page before). A `limit` out of range is clamped.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde::Deserialize;

use super::answers::{SessionList, SessionSummary, StepHistory};
use super::{query, ApiError, ApiState, ErrorCode};
use crate::flow::FlowCursor;

/// The most sessions one page lists; a larger `limit` is clamped to it.
pub const MAX_SESSION_PAGE: i64 = 1000;
/// The most Step history entries one page holds (and the default).
pub const MAX_HISTORY_PAGE: i64 = 1000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListSessionsQuery {
    #[serde(default)]
    agent: Option<String>,
    /// Clamped to 1..=[`MAX_SESSION_PAGE`].
    #[serde(default)]
    limit: Option<i64>,
    #[serde(default)]
    cursor: Option<String>,
}

/// A cursor as the API shows it: opaque, URL-safe.
fn encode_cursor(cursor: &FlowCursor) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}:{}", cursor.created_at, cursor.flow_id))
}

fn decode_cursor(text: &str) -> Result<FlowCursor, ApiError> {
    let invalid = || {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidCursor,
            "cursor is not one this server gave (pass a page's next_cursor as it is)",
        )
    };
    let bytes = URL_SAFE_NO_PAD.decode(text).map_err(|_| invalid())?;
    let text = String::from_utf8(bytes).map_err(|_| invalid())?;
    let (created, flow_id) = text.split_once(':').ok_or_else(invalid)?;
    Ok(FlowCursor {
        created_at: created.parse().map_err(|_| invalid())?,
        flow_id: flow_id.to_string(),
    })
}

/// `GET /v1/sessions`: one page of sessions, newest first, and the cursor
/// of the next (null on the last page).
pub(super) async fn list_sessions(
    State(state): State<ApiState>,
    params: Result<Query<ListSessionsQuery>, QueryRejection>,
) -> Result<Json<SessionList>, ApiError> {
    let params = query(params)?;
    if let Some(agent) = &params.agent {
        state.agent(agent)?;
    }
    let after = params.cursor.as_deref().map(decode_cursor).transpose()?;
    let limit = params.limit.unwrap_or(100).clamp(1, MAX_SESSION_PAGE) as usize;
    // One more than the page: whether another follows.
    let mut flows = state
        .deployment
        .store
        .list_flows(params.agent.as_deref(), after.as_ref(), limit + 1)
        .await?;
    let more = flows.len() > limit;
    flows.truncate(limit);
    let next_cursor = more
        .then(|| flows.last().map(|f| encode_cursor(&FlowCursor::after(f))))
        .flatten();
    // Sessions of agents this server does not serve are left out, so a page
    // may hold fewer than `limit`; the cursor still moves past them.
    let sessions = flows
        .into_iter()
        .filter(|f| state.deployment.config.agents.contains_key(&f.flow_type))
        .map(SessionSummary::from)
        .collect();
    Ok(Json(SessionList {
        sessions,
        next_cursor,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HistoryQuery {
    /// Entries after this one (a page's `next_after`).
    #[serde(default)]
    after: Option<i64>,
    /// Clamped to 1..=[`MAX_HISTORY_PAGE`].
    #[serde(default)]
    limit: Option<i64>,
}

/// `GET /v1/sessions/{id}/history`: one page of the Step history, oldest
/// first, and where the next starts (null on the last page).
pub(super) async fn step_history(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
    params: Result<Query<HistoryQuery>, QueryRejection>,
) -> Result<Json<StepHistory>, ApiError> {
    let params = query(params)?;
    state.session(&session_id).await?;
    let limit = params
        .limit
        .unwrap_or(MAX_HISTORY_PAGE)
        .clamp(1, MAX_HISTORY_PAGE) as usize;
    let mut page = state
        .deployment
        .store
        .step_history_page(&session_id, params.after, limit + 1)
        .await?;
    let more = page.len() > limit;
    page.truncate(limit);
    let next_after = more.then(|| page.last().map(|(id, _)| *id)).flatten();
    let steps = page.into_iter().map(|(_, entry)| entry).collect();
    Ok(Json(StepHistory { steps, next_after }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_as_it_was_written() {
        let cursor = FlowCursor {
            created_at: 1_700_000_000_123,
            flow_id: "agent-1:with:colons/and ünïcode".to_string(),
        };
        assert_eq!(decode_cursor(&encode_cursor(&cursor)).ok(), Some(cursor));
    }

    #[test]
    fn a_cursor_the_server_did_not_give_is_a_typed_400() {
        let not_utf8 = URL_SAFE_NO_PAD.encode([0xff, 0xfe, b':']);
        let no_colon = URL_SAFE_NO_PAD.encode("12345");
        let not_a_number = URL_SAFE_NO_PAD.encode("soon:s1");
        for bad in ["", "!!!", &not_utf8, &no_colon, &not_a_number] {
            let err = decode_cursor(bad).expect_err(bad);
            assert_eq!(
                (err.status, err.code),
                (StatusCode::BAD_REQUEST, ErrorCode::InvalidCursor)
            );
        }
    }
}
