//! Waiting for the turn a sent message starts: what `POST
//! /v1/sessions/{id}/messages?wait=SECONDS` and `dexa session send --wait`
//! answer with.
//!
//! The waiter follows the session's event stream from where it stood before
//! the send, woken by the store's stream signal (no fixed sleep): the
//! `turn_started` event that carries the message's id names the turn, and
//! that turn's `turn_completed`, `turn_failed` or `interrupt_raised` ends
//! the wait. Only the host's own events count (a guest cannot write these
//! types, and events a guest wrote are skipped anyway). A session that ends
//! first (a stop, here or in another process) ends the wait too: a stop
//! appends nothing, so a waiter that finds nothing new, or whose flow's
//! readers were woken by a stop since it last looked, looks at the
//! session's status. Waiting changes nothing: a waiter that goes away (a
//! client that disconnects) leaves the turn running.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use super::client::{AgentSessionClient, SessionError};
use super::records::{
    event_type, message_sequence_key, AgentEvent, AgentInterrupt, AgentMessage, AgentUsage,
    AGENT_MESSAGES,
};
use crate::flow::{FlowStatus, MapQuery, RpcError, StoreError};

/// The longest wait a caller may ask for.
pub const MAX_TURN_WAIT: Duration = Duration::from_secs(300);

/// How long a waiter sleeps between reads when its store cannot push
/// appends to it.
const WAIT_POLL: Duration = Duration::from_millis(50);

/// With a push signal, the longest pause between reads: it only covers a
/// notification lost in a reconnect.
const WAIT_PUSH_FALLBACK: Duration = Duration::from_secs(2);

/// Events one read takes.
const WAIT_PAGE: usize = 200;

/// A completed turn's messages one read takes.
const TURN_PAGE: usize = 32;

/// How the wait for a sent message's turn ended.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum TurnWait {
    /// The turn completed: the messages it added after the user's, and what
    /// its model calls used.
    Completed {
        turn_id: String,
        messages: Vec<AgentMessage>,
        usage: AgentUsage,
    },
    /// The turn failed, or the message was given up before its turn ran.
    Failed {
        turn_id: Option<String>,
        error: String,
    },
    /// The turn was cancelled (see
    /// [`AgentSessionClient::cancel_turn`]).
    Cancelled { turn_id: String },
    /// The turn waits for a person to approve or reject these tool calls.
    WaitingForApproval {
        turn_id: String,
        interrupts: Vec<AgentInterrupt>,
    },
    /// The session ended (it was stopped) before the turn did; the turn
    /// never ends now. `session_status` is the session's (`stopped`, or
    /// `failed` or `completed` for a session that ended so).
    SessionEnded {
        turn_id: Option<String>,
        session_status: String,
    },
    /// The wait ran out: the turn is running, or (no turn id) the message
    /// is still queued behind another turn.
    Running { turn_id: Option<String> },
}

impl TurnWait {
    /// Whether the turn reached its end (completed, failed or cancelled),
    /// or the session did.
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            TurnWait::Completed { .. }
                | TurnWait::Failed { .. }
                | TurnWait::Cancelled { .. }
                | TurnWait::SessionEnded { .. }
        )
    }
}

/// What the waiter knows of the message's turn so far.
#[derive(Default)]
struct Followed {
    turn_id: Option<String>,
    /// The user message's sequence, from `turn_started`.
    user_sequence: u64,
    usage: AgentUsage,
}

/// What one event means for the wait: nothing yet, or its end.
enum Seen {
    Nothing,
    Ended(TurnWait),
    /// An interrupt was raised: the wait ends unless it was answered
    /// already (then the turn goes on).
    Interrupt,
}

fn follow(message_id: &str, followed: &mut Followed, event: &AgentEvent) -> Seen {
    if event.origin.is_some() {
        return Seen::Nothing;
    }
    let of_message = event.data.get("message_id").and_then(|v| v.as_str()) == Some(message_id);
    let Some(turn) = followed.turn_id.clone() else {
        if !of_message {
            return Seen::Nothing;
        }
        return match event.event_type.as_str() {
            event_type::TURN_STARTED => {
                followed.turn_id = Some(event.turn_id.clone());
                followed.user_sequence = event
                    .data
                    .get("sequence")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(0);
                Seen::Nothing
            }
            // Given up before its turn ran.
            event_type::TURN_FAILED => Seen::Ended(TurnWait::Failed {
                turn_id: Some(event.turn_id.clone()),
                error: error_of(event),
            }),
            _ => Seen::Nothing,
        };
    };
    if event.turn_id != turn {
        return Seen::Nothing;
    }
    match event.event_type.as_str() {
        event_type::USAGE_RECORDED => {
            if let Some(recorded) = event
                .data
                .get("recorded")
                .and_then(|v| serde_json::from_value::<AgentUsage>(v.clone()).ok())
            {
                followed.usage.add(&recorded);
            }
            Seen::Nothing
        }
        event_type::TURN_FAILED => Seen::Ended(TurnWait::Failed {
            turn_id: Some(turn),
            error: error_of(event),
        }),
        event_type::TURN_COMPLETED => Seen::Ended(TurnWait::Completed {
            turn_id: turn,
            messages: Vec::new(),
            usage: followed.usage,
        }),
        event_type::TURN_CANCELLED => Seen::Ended(TurnWait::Cancelled { turn_id: turn }),
        event_type::INTERRUPT_RAISED => Seen::Interrupt,
        _ => Seen::Nothing,
    }
}

/// Whether a page took the waiter to the stream's head, so that it waits
/// for the next append's signal (armed before the read) rather than
/// reading again. `after` is the sequence of the page's last readable
/// event, `read` how many it had, `next` the sequence the stream's next
/// append gets, as the page saw it.
///
/// A page that reached the head needs no second read to be sure: every
/// append after it wakes the waiter. A page of only unreadable events is
/// stepped over (`after` moves to the head). Otherwise (a full page, or
/// unreadable events at its end) the waiter reads on at once.
fn caught_up(after: &mut i64, read: usize, next: i64) -> bool {
    let head = next.saturating_sub(1);
    if *after >= head {
        return true;
    }
    if read == 0 {
        *after = head;
    }
    false
}

fn error_of(event: &AgentEvent) -> String {
    event
        .data
        .get("error")
        .and_then(|v| v.as_str())
        .unwrap_or("the turn failed")
        .to_string()
}

impl AgentSessionClient {
    /// The sequence of the session's newest event: a send's waiter starts
    /// after it, before the send, so that it cannot miss its turn's start.
    pub async fn event_head(&self, session_id: &str) -> Result<i64, SessionError> {
        let (_, next) = self.read_events(session_id, i64::MAX - 1, 1).await?;
        Ok(next.saturating_sub(1))
    }

    /// Waits up to `timeout` (at most [`MAX_TURN_WAIT`]) for the turn that
    /// message `message_id` starts, following the session's events after
    /// `after_seq` (see [`Self::event_head`]).
    pub async fn wait_for_turn(
        &self,
        session_id: &str,
        message_id: &str,
        after_seq: i64,
        timeout: Duration,
    ) -> Result<TurnWait, SessionError> {
        self.wait_reading(session_id, message_id, after_seq, timeout, |after| {
            self.read_events(session_id, after, WAIT_PAGE)
        })
        .await
    }

    /// [`Self::wait_for_turn`], reading the events through `read` (a page
    /// after a sequence, and the stream's next sequence): the test counts
    /// the reads through it.
    async fn wait_reading<R, F>(
        &self,
        session_id: &str,
        message_id: &str,
        after_seq: i64,
        timeout: Duration,
        mut read: R,
    ) -> Result<TurnWait, SessionError>
    where
        R: FnMut(i64) -> F,
        F: Future<Output = Result<(Vec<(i64, AgentEvent)>, i64), SessionError>>,
    {
        let deadline = Instant::now() + timeout.min(MAX_TURN_WAIT);
        let mut after = after_seq;
        let mut followed = Followed::default();
        // The session's status once seen ended; the read after that one
        // saw every event it will ever have.
        let mut ended: Option<FlowStatus> = None;
        // The stop wakes counted when the status was last read; none yet,
        // so the first pass at the head reads it (the session may have been
        // stopped before this wait, or before its signal was taken). A stop
        // since may have reached the waiter with an append's wake.
        let mut stops_seen: Option<u64> = None;
        // Held for the whole wait: the flow's entry (and its stop count)
        // stays, and the store's watch keeps looking at the flow.
        let signal = self.event_signal(session_id);
        loop {
            // Armed before the read, so that an append between the read and
            // the wait still wakes it.
            let notified = signal.as_ref().map(|signal| signal.notified());
            tokio::pin!(notified);
            if let Some(notified) = notified.as_mut().as_pin_mut() {
                notified.enable();
            }
            // A session seen ended gets its last read whatever the time: no
            // event follows a stop, so the reading ends.
            if Instant::now() >= deadline && ended.is_none() {
                return Ok(TurnWait::Running {
                    turn_id: followed.turn_id,
                });
            }
            let (page, next) = read(after).await?;
            let read = page.len();
            // The session was seen ended while this page was handled: the
            // events are read once more before the answer.
            let mut ended_now = false;
            for (seq, event) in &page {
                after = *seq;
                match follow(message_id, &mut followed, event) {
                    Seen::Nothing => {}
                    Seen::Ended(TurnWait::Completed { turn_id, usage, .. }) => {
                        let messages = self
                            .turn_messages(session_id, &turn_id, followed.user_sequence)
                            .await?;
                        return Ok(TurnWait::Completed {
                            turn_id,
                            messages,
                            usage,
                        });
                    }
                    Seen::Ended(ended) => return Ok(ended),
                    Seen::Interrupt => {
                        let turn_id = followed.turn_id.clone().unwrap_or_default();
                        let snapshot = self.get_agent_snapshot(session_id).await?;
                        // A stopped session keeps its pending approvals, but
                        // nobody can answer them now.
                        if snapshot.flow_status != FlowStatus::Running {
                            if ended.is_none() {
                                ended = Some(snapshot.flow_status);
                                ended_now = true;
                            }
                            continue;
                        }
                        let interrupts: Vec<AgentInterrupt> = snapshot
                            .pending_interrupts
                            .into_iter()
                            .filter(|i| i.turn_id == turn_id)
                            .collect();
                        if !interrupts.is_empty() {
                            return Ok(TurnWait::WaitingForApproval {
                                turn_id,
                                interrupts,
                            });
                        }
                    }
                }
            }
            if ended_now || !caught_up(&mut after, read, next) {
                continue;
            }
            if let Some(status) = ended {
                return Ok(TurnWait::SessionEnded {
                    turn_id: followed.turn_id,
                    session_status: status.as_str().to_string(),
                });
            }
            // Nothing new, or a stop's wake counted since the last look: the
            // wake may have been a stop (which appends nothing). Read once
            // more after seeing it, since the turn may have ended between
            // that read and the stop.
            let stops = self.event_stops(session_id);
            if read == 0 || stops_seen != Some(stops) {
                stops_seen = Some(stops);
                ended = self.session_ended(session_id).await?;
                if ended.is_some() {
                    continue;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(TurnWait::Running {
                    turn_id: followed.turn_id,
                });
            }
            let left = deadline - now;
            match notified.as_mut().as_pin_mut() {
                Some(notified) => {
                    let _ = tokio::time::timeout(left.min(WAIT_PUSH_FALLBACK), notified).await;
                }
                None => tokio::time::sleep(left.min(WAIT_POLL)).await,
            }
        }
    }

    /// The session's status when it no longer runs (a session that is gone
    /// counts as stopped).
    async fn session_ended(&self, session_id: &str) -> Result<Option<FlowStatus>, SessionError> {
        let flow = self
            .flow_client()
            .store()
            .flow(session_id)
            .await
            .map_err(RpcError::Store)?;
        Ok(match flow {
            Some(flow) if flow.status == FlowStatus::Running => None,
            Some(flow) => Some(flow.status),
            None => Some(FlowStatus::Stopped),
        })
    }

    /// The messages `turn_id` added after its user message, oldest first.
    /// Read inline, a page of [`TURN_PAGE`] at a time: a turn adds a few
    /// messages, and the answer is on the wait's critical path, where a
    /// hop to a blocking thread and back costs more than the read.
    async fn turn_messages(
        &self,
        session_id: &str,
        turn_id: &str,
        user_sequence: u64,
    ) -> Result<Vec<AgentMessage>, SessionError> {
        let mut messages = Vec::new();
        let mut after = user_sequence;
        loop {
            // One extra row tells whether another page follows.
            let rows = self
                .flow_client()
                .store()
                .read_map(
                    session_id,
                    AGENT_MESSAGES,
                    MapQuery {
                        after: Some(message_sequence_key(after)),
                        limit: TURN_PAGE + 1,
                        ..MapQuery::default()
                    },
                )
                .await
                .map_err(RpcError::Store)?;
            let more = rows.len() > TURN_PAGE;
            for (key, value) in rows.into_iter().take(TURN_PAGE) {
                let message: AgentMessage = serde_json::from_value(value.value).map_err(|err| {
                    RpcError::Store(StoreError::Corrupt(format!("message {key}: {err}")))
                })?;
                if message.turn_id != turn_id {
                    return Ok(messages);
                }
                after = message.sequence;
                messages.push(message);
            }
            if !more {
                return Ok(messages);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(event_type: &str, turn: &str, data: serde_json::Value) -> AgentEvent {
        AgentEvent {
            event_type: event_type.to_string(),
            turn_id: turn.to_string(),
            step_execution_id: "s".to_string(),
            attempt: 1,
            origin: None,
            data,
        }
    }

    #[test]
    fn only_the_turn_started_by_the_message_is_followed() {
        let mut followed = Followed::default();
        let other = event(
            event_type::TURN_STARTED,
            "turn-1",
            json!({"sequence": 1, "message_id": "msg-other"}),
        );
        assert!(matches!(
            follow("msg-a", &mut followed, &other),
            Seen::Nothing
        ));
        let done_other = event(event_type::TURN_COMPLETED, "turn-1", json!({}));
        assert!(matches!(
            follow("msg-a", &mut followed, &done_other),
            Seen::Nothing
        ));
        let mine = event(
            event_type::TURN_STARTED,
            "turn-2",
            json!({"sequence": 3, "message_id": "msg-a"}),
        );
        assert!(matches!(
            follow("msg-a", &mut followed, &mine),
            Seen::Nothing
        ));
        assert_eq!(followed.turn_id.as_deref(), Some("turn-2"));
        assert_eq!(followed.user_sequence, 3);
        let usage = event(
            event_type::USAGE_RECORDED,
            "turn-2",
            json!({"recorded": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7, "model_calls": 1}}),
        );
        follow("msg-a", &mut followed, &usage);
        follow("msg-a", &mut followed, &usage);
        match follow(
            "msg-a",
            &mut followed,
            &event(event_type::TURN_COMPLETED, "turn-2", json!({})),
        ) {
            Seen::Ended(TurnWait::Completed { turn_id, usage, .. }) => {
                assert_eq!(turn_id, "turn-2");
                assert_eq!(usage.total_tokens, 14);
                assert_eq!(usage.model_calls, 2);
            }
            _ => panic!("the turn's completion ends the wait"),
        }
    }

    #[test]
    fn a_guest_event_never_ends_the_wait() {
        let mut followed = Followed {
            turn_id: Some("turn-1".to_string()),
            ..Followed::default()
        };
        let mut forged = event(event_type::TURN_COMPLETED, "turn-1", json!({}));
        forged.origin = Some("guest".to_string());
        assert!(matches!(
            follow("msg-a", &mut followed, &forged),
            Seen::Nothing
        ));
    }

    #[test]
    fn a_message_given_up_before_its_turn_ran_ends_the_wait_failed() {
        let mut followed = Followed::default();
        let failed = event(
            event_type::TURN_FAILED,
            "turn-4",
            json!({"error": "the user message could not be used", "message_id": "msg-a"}),
        );
        match follow("msg-a", &mut followed, &failed) {
            Seen::Ended(TurnWait::Failed { turn_id, error }) => {
                assert_eq!(turn_id.as_deref(), Some("turn-4"));
                assert!(error.contains("could not be used"));
            }
            _ => panic!("a given-up message ends the wait"),
        }
    }

    /// A session client on a `synchronous=NORMAL` SQLite store in `dir`,
    /// with no flows registered (nothing runs; the tests write what they
    /// read), and the store itself.
    fn sessions_on_sqlite(
        dir: &std::path::Path,
    ) -> (
        std::sync::Arc<dyn crate::flow::FlowStore>,
        AgentSessionClient,
    ) {
        use std::sync::Arc;

        use crate::flow::{FlowClient, FlowStore, Registry};
        use crate::store::sqlite::SqliteStore;

        let store: Arc<dyn FlowStore> = Arc::new(SqliteStore::open_normal_for_test(dir));
        let registry = Arc::new(Registry::new([]).expect("registry"));
        let sessions = AgentSessionClient::new(FlowClient::new(store.clone(), registry), "Agent");
        (store, sessions)
    }

    /// A completed turn's messages come back whole across pages, and stop
    /// at the next turn's first message or at the end of the session.
    #[test]
    fn a_turns_messages_are_read_across_pages_up_to_the_next_turn() {
        use crate::session::records::MessageRole;

        let dir = tempfile::tempdir().expect("tempdir");
        let (store, sessions) = sessions_on_sqlite(dir.path());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            // Sequence 1 is turn-2's user message; 2..=41 are its answer,
            // 42 and 43 the next turn's.
            let turn_of = |sequence: u64| match sequence {
                1..=41 => "turn-2",
                _ => "turn-3",
            };
            let body: crate::flow::store::RpcBody = Box::new(move |tx| {
                for sequence in 1..=43_u64 {
                    let message = AgentMessage {
                        sequence,
                        turn_id: turn_of(sequence).to_string(),
                        role: MessageRole::Assistant,
                        framework_item: "{}".to_string(),
                        text: Some(format!("m{sequence}")),
                    };
                    let value = serde_json::to_value(&message)
                        .map_err(|err| RpcError::Rejected(err.to_string()))?;
                    tx.set(AGENT_MESSAGES, &message_sequence_key(sequence), value)?;
                }
                Ok(Box::new(()) as Box<dyn std::any::Any + Send>)
            });
            store.rpc("s", body).await.expect("messages stored");
            let sequences = |messages: Vec<AgentMessage>| {
                messages.iter().map(|m| m.sequence).collect::<Vec<_>>()
            };
            let turn = sessions
                .turn_messages("s", "turn-2", 1)
                .await
                .expect("turn-2");
            assert_eq!(sequences(turn), (2..=41).collect::<Vec<_>>());
            let last = sessions
                .turn_messages("s", "turn-3", 41)
                .await
                .expect("turn-3");
            assert_eq!(sequences(last), vec![42, 43]);
        });
    }

    /// A stop appends nothing, and its wake may reach a waiter together
    /// with an append's (one look of the store's watch, one batch of
    /// PostgreSQL notifications): the waiter then reads the append, not
    /// nothing. It looks at the session's status all the same, because the
    /// stop's wake was counted, and answers at once, not at its fallback
    /// read 2 s later (past this wait's 1.5 s, where it would answer
    /// `Running`). The pages are the test's; the stop (by another process:
    /// its wake comes from the watch alone, once), its count and the status
    /// are the stores'.
    #[test]
    fn a_stop_whose_wake_came_with_an_append_ends_the_wait() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;

        use crate::flow::FlowStore;

        let dir = tempfile::tempdir().expect("tempdir");
        let (store, sessions) = sessions_on_sqlite(dir.path());
        let other = crate::store::sqlite::SqliteStore::open_normal_for_test(dir.path());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let task = |step_type: &str| crate::flow::NewTask {
                step_type: step_type.into(),
                input: json!({}),
                wait: None,
                policy: crate::flow::RetryPolicy::default(),
                failure_route: None,
                failure: None,
                locks: Vec::new(),
                not_before: 0,
            };
            store
                .create_flow("s", "Agent", task("Step"))
                .await
                .expect("a flow");
            // The first read after the stop's wake was counted: one page
            // with an append the wake came with; nothing before or after.
            let appended = Arc::new(AtomicBool::new(false));
            let reads = Arc::new(AtomicUsize::new(0));
            let waiter = {
                let (sessions, store, appended, reads) = (
                    sessions.clone(),
                    store.clone(),
                    appended.clone(),
                    reads.clone(),
                );
                tokio::spawn(async move {
                    sessions
                        .wait_reading("s", "msg-a", 0, Duration::from_millis(1500), |_| {
                            let page = if store.stream_stops("s") > 0
                                && !appended.swap(true, Ordering::SeqCst)
                            {
                                vec![(1, event("step_started", "turn-1", json!({})))]
                            } else {
                                Vec::new()
                            };
                            let next = if appended.load(Ordering::SeqCst) {
                                2
                            } else {
                                1
                            };
                            reads.fetch_add(1, Ordering::SeqCst);
                            std::future::ready(Ok::<_, SessionError>((page, next)))
                        })
                        .await
                })
            };
            let reached = |n: usize| {
                let reads = reads.clone();
                tokio::time::timeout(Duration::from_secs(10), async move {
                    while reads.load(Ordering::SeqCst) < n {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                })
            };
            reached(1).await.expect("the waiter's first read");
            // The store's watch looks at the new reader's flow once (a
            // commit elsewhere), and wakes it; after that the stop moves
            // nothing it reads but the stop count.
            store
                .create_flow("other", "Agent", task("Step"))
                .await
                .expect("another flow");
            reached(2)
                .await
                .expect("the watch's first look at the flow woke the waiter");
            assert!(other.stop_flow("s").await.expect("the stop"));
            let waited = waiter.await.expect("the waiter").expect("a wait");
            assert_eq!(
                waited,
                TurnWait::SessionEnded {
                    turn_id: None,
                    session_status: "stopped".to_string()
                }
            );
        });
    }

    /// A session stopped before the wait began (a keyed retry of a send
    /// whose session was stopped since): the first read finds the turn's
    /// old events, not nothing, and no stop's wake comes during the wait.
    /// The waiter looks at the status at its first pass at the head all the
    /// same, and answers at once (not `Running` at its deadline).
    #[test]
    fn a_wait_on_a_session_stopped_before_it_began_ends_at_its_first_look() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;

        let dir = tempfile::tempdir().expect("tempdir");
        let (store, sessions) = sessions_on_sqlite(dir.path());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let first = crate::flow::NewTask {
                step_type: "Step".into(),
                input: json!({}),
                wait: None,
                policy: crate::flow::RetryPolicy::default(),
                failure_route: None,
                failure: None,
                locks: Vec::new(),
                not_before: 0,
            };
            store
                .create_flow("s", "Agent", first)
                .await
                .expect("a flow");
            assert!(store.stop_flow("s").await.expect("the stop"));
            // The store's watch (every 10 ms) sees these commits before the
            // waiter reads: its first look at a new reader's flow would wake
            // the waiter, and that wake, not the first look at the status,
            // would end the wait.
            tokio::time::sleep(Duration::from_millis(200)).await;
            // The turn's events, then nothing (no event follows a stop).
            let read_once = Arc::new(AtomicBool::new(false));
            let waited = sessions
                .wait_reading("s", "msg-a", 0, Duration::from_millis(1500), |_| {
                    let page = if read_once.swap(true, Ordering::SeqCst) {
                        Vec::new()
                    } else {
                        vec![(
                            1,
                            event(
                                event_type::TURN_STARTED,
                                "turn-1",
                                json!({"sequence": 1, "message_id": "msg-a"}),
                            ),
                        )]
                    };
                    std::future::ready(Ok::<_, SessionError>((page, 2)))
                })
                .await
                .expect("a wait");
            assert_eq!(
                waited,
                TurnWait::SessionEnded {
                    turn_id: Some("turn-1".to_string()),
                    session_status: "stopped".to_string()
                }
            );
        });
    }

    /// A page that reached the stream's head is not read again to be
    /// sure, and the store's stream watch does not wake the waiter again
    /// for this process's own appends. Each append wakes the waiter once
    /// (the appender's own signal), so N appends cost N + 1 reads (13 here
    /// in each of four runs). The bound leaves room for seven more: the
    /// watch's first look at the new flow, a fallback wake of a stalled
    /// machine, and looks of the watch that land between an append's
    /// commit and its report on a loaded one. Before, the watch woke the
    /// waiter for each append too (2N, 24 here), and reading on until an
    /// empty page cost a further read a wake (34 or 35). A watch that
    /// forgets the reported head when the waiter lets go of its signal
    /// between reads (19 here) is caught by the store's own tests.
    #[test]
    fn a_waiter_reads_once_a_wake_not_again_to_confirm_the_head() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;

        use crate::session::records::AGENT_EVENTS;

        let dir = tempfile::tempdir().expect("tempdir");
        let (store, sessions) = sessions_on_sqlite(dir.path());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            // A flow for the events; its Step never runs (no worker).
            let first = crate::flow::NewTask {
                step_type: "Step".into(),
                input: json!({}),
                wait: None,
                policy: crate::flow::RetryPolicy::default(),
                failure_route: None,
                failure: None,
                locks: Vec::new(),
                not_before: 0,
            };
            store
                .create_flow("s", "Agent", first)
                .await
                .expect("a flow");
            let reads = Arc::new(AtomicUsize::new(0));
            let waiter = {
                let (sessions, reads) = (sessions.clone(), reads.clone());
                tokio::spawn(async move {
                    sessions
                        .wait_reading("s", "msg-a", 0, Duration::from_secs(30), |after| {
                            reads.fetch_add(1, Ordering::SeqCst);
                            sessions.read_events("s", after, WAIT_PAGE)
                        })
                        .await
                })
            };
            while reads.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let events = [
                event(
                    event_type::TURN_STARTED,
                    "turn-1",
                    json!({"sequence": 1, "message_id": "msg-a"}),
                ),
                event("step_started", "turn-1", json!({})),
                event("tool_call_completed", "turn-1", json!({})),
                event("tool_call_completed", "turn-1", json!({})),
                event("tool_call_completed", "turn-1", json!({})),
                event("tool_call_completed", "turn-1", json!({})),
                event("step_completed", "turn-1", json!({})),
                event("step_started", "turn-1", json!({})),
                event("message_appended", "turn-1", json!({})),
                event("message_appended", "turn-1", json!({})),
                event("step_completed", "turn-1", json!({})),
                event(
                    event_type::TURN_COMPLETED,
                    "turn-1",
                    json!({"message_count": 0}),
                ),
            ];
            let appends = events.len();
            for event in events {
                let payload = serde_json::to_value(&event).expect("an event");
                store
                    .append_stream("s", AGENT_EVENTS, vec![payload])
                    .await
                    .expect("appended");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let waited = waiter.await.expect("the waiter").expect("a wait");
            assert!(
                matches!(&waited, TurnWait::Completed { turn_id, .. } if turn_id == "turn-1"),
                "{waited:?}"
            );
            let reads = reads.load(Ordering::SeqCst);
            assert!(
                reads <= appends + 7,
                "{reads} reads for {appends} appends: a page at the head was read again, or the watch woke the waiter for this process's appends"
            );
        });
    }
}
