//! `GET /v1/sessions/{id}/events`: the session's events as Server-Sent
//! Events, resumable with `Last-Event-ID` (or `?after=`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;
use serde::Deserialize;

use super::{query, ApiError, ApiState};
use crate::session::AgentEvent;

/// How often an SSE stream looks for new events (other processes write them).
const EVENT_POLL: Duration = Duration::from_millis(50);
/// How long an event stream whose store pushes appends waits without one
/// before it reads anyway.
const EVENT_PUSH_FALLBACK: Duration = Duration::from_secs(2);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EventsQuery {
    /// Start after this event id (as `Last-Event-ID` does).
    #[serde(default)]
    after: Option<i64>,
}

/// The session's events as SSE: `id` is the stream sequence, `event` the
/// event type, `data` the event as JSON. Reconnecting with `Last-Event-ID`
/// (or `?after=`) resumes after that event.
pub(super) async fn events(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
    params: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let params = query(params)?;
    let (sessions, _) = state.session(&session_id).await?;
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<i64>().ok())
                .ok_or_else(|| ApiError::bad_request("Last-Event-ID must be an event id"))?,
        ),
    };
    let after = last_event_id.or(params.after).unwrap_or(0);
    let stream = futures_util::stream::unfold(
        (
            sessions,
            session_id,
            after,
            VecDeque::<(i64, AgentEvent)>::new(),
        ),
        |(sessions, session_id, mut after, mut buffered)| async move {
            loop {
                if let Some((seq, event)) = buffered.pop_front() {
                    // Stored types are names; one that is not is sent unnamed
                    // rather than breaking the stream (Event::event panics on
                    // a line break).
                    let named = !event.event_type.is_empty()
                        && !event.event_type.chars().any(char::is_control);
                    let sse = Event::default().id(seq.to_string());
                    let sse = if named {
                        sse.event(event.event_type.clone())
                    } else {
                        sse
                    };
                    let sse = match serde_json::to_string(&event) {
                        Ok(data) => {
                            ::metrics::counter!(crate::telemetry::EVENT_STREAM_BYTES)
                                .increment(data.len() as u64);
                            sse.data(data)
                        }
                        Err(_) => Event::default().comment("unencodable event"),
                    };
                    return Some((Ok(sse), (sessions, session_id, after, buffered)));
                }
                // Armed before the read, so that an append between the read
                // and the wait still wakes it.
                let signal = sessions.event_signal(&session_id);
                let notified = signal.as_ref().map(|signal| signal.notified());
                tokio::pin!(notified);
                if let Some(notified) = notified.as_mut().as_pin_mut() {
                    notified.enable();
                }
                match sessions.read_events(&session_id, after, 200).await {
                    Ok((page, _)) if !page.is_empty() => {
                        if let Some((last, _)) = page.last() {
                            after = *last;
                        }
                        buffered.extend(page);
                    }
                    // A page of only unreadable events: step over it.
                    Ok((_, next)) if next - 1 > after => after = next - 1,
                    Ok(_) => match notified.as_mut().as_pin_mut() {
                        // Pushed: the next append wakes it; the long pause
                        // only covers a notification lost in a reconnect.
                        Some(notified) => {
                            let _ = tokio::time::timeout(EVENT_PUSH_FALLBACK, notified).await;
                        }
                        None => tokio::time::sleep(EVENT_POLL).await,
                    },
                    Err(err) => {
                        tracing::warn!(session_id, error = %err, "event stream ended");
                        return None;
                    }
                }
            }
        },
    );
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}
