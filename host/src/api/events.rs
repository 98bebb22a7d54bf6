//! `GET /v1/sessions/{id}/events`: the session's events as Server-Sent
//! Events, resumable with `Last-Event-ID` (or `?after=`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::answers::SessionEnded;
use super::{query, ApiError, ApiState};
use crate::flow::{FlowInfo, FlowStatus, FlowStore};
use crate::session::{AgentEvent, AgentSessionClient};

/// How often an SSE stream looks for new events (other processes write them).
const EVENT_POLL: Duration = Duration::from_millis(50);
/// How long an event stream whose store pushes appends waits without one
/// before it reads anyway.
const EVENT_PUSH_FALLBACK: Duration = Duration::from_secs(2);
/// How often a stream of a running session looks whether it has ended.
const STATUS_CHECK: Duration = Duration::from_secs(1);
/// The SSE event that ends the stream of a session that has ended.
pub const SESSION_ENDED: &str = crate::session::event_type::SESSION_ENDED;

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
///
/// When the session has ended (stopped, failed or completed) and every
/// event is sent, a last `session_ended` event (`id` the last event's, 0
/// when none; `data` is `{"session_id", "status", "error"}`) ends the
/// stream. A reconnect (with `Last-Event-ID`) to an ended session with
/// nothing left to send gets 204, which tells a browser's `EventSource` to
/// stop reconnecting.
pub(super) async fn events(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
    headers: HeaderMap,
    params: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let params = query(params)?;
    let (sessions, flow) = state.session(&session_id).await?;
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
    if last_event_id.is_some() && flow.status != FlowStatus::Running {
        // The status was read before the events: none can follow these.
        let (page, next) = sessions.read_events(&session_id, after, 1).await?;
        if page.is_empty() && next - 1 <= after {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
    }
    let tail = Tail {
        sessions,
        store: state.deployment.store.clone(),
        session_id,
        after,
        buffered: VecDeque::new(),
        ended: None,
        checked: None,
        done: false,
    };
    let stream = futures_util::stream::unfold(tail, |mut tail| async move {
        let event = tail.next().await?;
        Some((Ok::<_, Infallible>(event), tail))
    });
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response())
}

/// Where one SSE stream stands.
struct Tail {
    sessions: AgentSessionClient,
    store: Arc<dyn FlowStore>,
    session_id: String,
    /// The last event sent (or skipped).
    after: i64,
    buffered: VecDeque<(i64, AgentEvent)>,
    /// The session as last seen once it had ended (an ended session never
    /// runs again).
    ended: Option<FlowInfo>,
    /// When the status was last read.
    checked: Option<Instant>,
    /// `session_ended` is sent.
    done: bool,
}

impl Tail {
    /// The next SSE event; none ends the stream.
    async fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        loop {
            if let Some((seq, event)) = self.buffered.pop_front() {
                return Some(sse_event(seq, &event));
            }
            // Armed before the reads, so that an append or a stop between
            // them and the wait still wakes it.
            let signal = self.sessions.event_signal(&self.session_id);
            let notified = signal.as_ref().map(|signal| signal.notified());
            tokio::pin!(notified);
            if let Some(notified) = notified.as_mut().as_pin_mut() {
                notified.enable();
            }
            match self
                .sessions
                .read_events(&self.session_id, self.after, 200)
                .await
            {
                Ok((page, _)) if !page.is_empty() => {
                    if let Some((last, _)) = page.last() {
                        self.after = *last;
                    }
                    self.buffered.extend(page);
                    continue;
                }
                // A page of only unreadable events: step over it.
                Ok((_, next)) if next - 1 > self.after => {
                    self.after = next - 1;
                    continue;
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(session_id = self.session_id, error = %err, "event stream ended");
                    return None;
                }
            }
            // Caught up. The status was read before this empty read: an
            // ended flow takes no more appends (the store refuses them), so
            // nothing more comes.
            if let Some(flow) = &self.ended {
                self.done = true;
                return Some(ended_event(flow, self.after));
            }
            // Seen ending now: read the events once more before the end.
            // A pushed stream wakes only on an append, a stop through this
            // API or its fallback pause, so it looks each time; a polled one
            // at most once per STATUS_CHECK.
            if self.check_status(signal.is_some()).await {
                continue;
            }
            match notified.as_mut().as_pin_mut() {
                // Pushed: the next append (or a stop through this API) wakes
                // it; the long pause covers a notification lost in a
                // reconnect and a stop by another process.
                Some(notified) => {
                    let _ = tokio::time::timeout(EVENT_PUSH_FALLBACK, notified).await;
                }
                None => tokio::time::sleep(EVENT_POLL).await,
            }
        }
    }

    /// Reads the session's status; true when it has ended. Unless
    /// `always`, at most once per [`STATUS_CHECK`]. A failed read is left to
    /// the next one: the event read reports a store that is down.
    async fn check_status(&mut self, always: bool) -> bool {
        let recent = self.checked.is_some_and(|at| at.elapsed() < STATUS_CHECK);
        if recent && !always {
            return false;
        }
        self.checked = Some(Instant::now());
        if let Ok(Some(flow)) = self.store.flow(&self.session_id).await {
            if flow.status != FlowStatus::Running {
                self.ended = Some(flow);
                return true;
            }
        }
        false
    }
}

/// One stored event as SSE.
fn sse_event(seq: i64, event: &AgentEvent) -> Event {
    // Stored types are names; one that is not is sent unnamed rather than
    // breaking the stream (Event::event panics on a line break).
    let named = !event.event_type.is_empty() && !event.event_type.chars().any(char::is_control);
    let sse = Event::default().id(seq.to_string());
    let sse = if named {
        sse.event(event.event_type.clone())
    } else {
        sse
    };
    match serde_json::to_string(event) {
        Ok(data) => {
            ::metrics::counter!(crate::telemetry::EVENT_STREAM_BYTES).increment(data.len() as u64);
            sse.data(data)
        }
        Err(_) => Event::default().comment("unencodable event"),
    }
}

/// The last event of an ended session's stream. Its id is the last
/// event's (0 when there was none), so that a browser's `EventSource`
/// reconnects with `Last-Event-ID` and gets 204, which stops it.
fn ended_event(flow: &FlowInfo, last: i64) -> Event {
    let data = SessionEnded {
        session_id: flow.flow_id.clone(),
        status: flow.status,
        error: flow.error.clone(),
    };
    let data = serde_json::to_string(&data).unwrap_or_default();
    Event::default()
        .id(last.to_string())
        .event(SESSION_ENDED)
        .data(data)
}
