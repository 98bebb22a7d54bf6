//! AgentSessionClient: the session's RPCs, each one transaction on the store.
//! Reads (snapshot, message pages) run in read-only transactions that never
//! take the store's writer; sends honour an idempotency key and refuse a
//! message over the user-message cap before anything is queued.

use crate::telemetry::traces::TurnTrace;
use sha2::{Digest, Sha256};

use crate::flow::{
    FlowClient, FlowError, FlowStatus, Json, MapQuery, RpcError, StateTx, StoreError,
};

use super::records::*;

/// Why a session call failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("session {0:?} does not exist")]
    NoSuchSession(String),
    /// The session never raised this interrupt (an answered or expired one
    /// is `Ok(false)` instead).
    #[error("session {session_id:?} has no interrupt {interrupt_id:?}")]
    NoSuchInterrupt {
        session_id: String,
        interrupt_id: String,
    },
    #[error("session {session_id:?} is {status}; it takes no more messages")]
    NotRunning { session_id: String, status: String },
    /// A user message over the client's cap ([`MAX_USER_MESSAGE_BYTES`] by
    /// default); nothing was queued or started.
    #[error("the message is {bytes} bytes, over the limit of {limit} bytes; nothing was queued")]
    MessageTooLarge { bytes: usize, limit: usize },
    /// An idempotency key that is empty, too long, or not printable ASCII.
    #[error("invalid idempotency key: {0}")]
    InvalidIdempotencyKey(String),
    /// The idempotency key was used before on this session with another
    /// text: it is not a retry, and nothing was queued.
    #[error(
        "idempotency key {key:?} was used before on session {session_id:?} with another message; \
         nothing was queued"
    )]
    IdempotencyKeyReused { session_id: String, key: String },
    /// Too many steering messages wait for one cancel to finish; nothing
    /// was queued.
    #[error(
        "{MAX_PENDING_STEERS} steering messages already wait for the cancel of {turn_id} on \
         session {session_id:?}; nothing was queued, try again when it has ended"
    )]
    SteersPending { session_id: String, turn_id: String },
    /// The session is in a turn, or has messages waiting for one; the
    /// request needs it idle. Nothing was written.
    #[error("session {session_id:?} is busy: {reason}; nothing was written")]
    Busy { session_id: String, reason: String },
    /// A request the session refuses as malformed. Nothing was written.
    #[error("{0}; nothing was written")]
    Invalid(String),
    #[error(transparent)]
    Flow(#[from] FlowError),
    #[error(transparent)]
    Rpc(#[from] RpcError),
}

/// What `resolve_interrupt` found.
enum Resolution {
    Resolved,
    NotPending,
    Unknown,
}

/// Runs the session RPCs of one agent (flow type).
#[derive(Clone)]
pub struct AgentSessionClient {
    client: FlowClient,
    flow_type: String,
    /// The largest user message this client queues.
    max_user_message_bytes: usize,
}

/// Oldest idempotency keys one send looks at for forgetting. A send records
/// one key and can forget up to this many, so the count never passes
/// [`MAX_IDEMPOTENCY_KEYS`], and each send's work stays bounded.
const IDEMPOTENCY_PRUNE_BATCH: usize = 16;

/// The longest text a send queues as a small write (see
/// [`crate::flow::FlowClient::rpc_small`]): with the bounded key pruning
/// above, such a send writes a few rows and a few KiB.
const SMALL_SEND_BYTES: usize = 16 << 10;

fn corrupt(what: &str, err: serde_json::Error) -> RpcError {
    RpcError::Store(StoreError::Corrupt(format!("{what}: {err}")))
}

fn decode<T: serde::de::DeserializeOwned>(
    what: &str,
    value: crate::flow::Json,
) -> Result<T, RpcError> {
    serde_json::from_value(value).map_err(|err| corrupt(what, err))
}

fn to_json<T: serde::Serialize>(what: &str, value: &T) -> Result<crate::flow::Json, RpcError> {
    serde_json::to_value(value).map_err(|err| corrupt(what, err))
}

/// Refuses a key that is not 1 to [`MAX_IDEMPOTENCY_KEY_BYTES`] printable
/// ASCII characters with no space at either end. HTTP trims the ends of a
/// header's value, so a key with end spaces would not survive a retry intact.
/// The message names the length, never the key, which may be anything.
fn check_idempotency_key(key: &str) -> Result<(), SessionError> {
    let printable = key.bytes().all(|b| (b' '..=b'~').contains(&b));
    let trimmed = !key.starts_with(' ') && !key.ends_with(' ');
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_BYTES || !printable || !trimmed {
        return Err(SessionError::InvalidIdempotencyKey(format!(
            "a key is 1 to {MAX_IDEMPOTENCY_KEY_BYTES} printable ASCII characters \
             (space to '~') with no space at either end; this one is {} bytes and {}",
            key.len(),
            if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_BYTES {
                "the wrong length"
            } else if !printable {
                "not printable ASCII"
            } else {
                "starts or ends with a space"
            }
        )));
    }
    Ok(())
}

/// The [`IDEMPOTENCY_KEY_ORDER`] key of `ordinal`.
fn idempotency_ordinal_key(ordinal: u64) -> String {
    format!("{ordinal:012}")
}

fn parse_idempotency_ordinal(order: &str) -> Result<u64, RpcError> {
    order.parse::<u64>().map_err(|err| {
        RpcError::Store(StoreError::Corrupt(format!(
            "idempotency key order {order:?}: {err}"
        )))
    })
}

/// Records `key` for a message queued in this transaction, then forgets the
/// oldest keys: those more than [`MAX_IDEMPOTENCY_KEYS`] keys old, and those
/// older than [`IDEMPOTENCY_KEY_RETENTION_MS`]. It walks at most
/// [`IDEMPOTENCY_PRUNE_BATCH`] keys, oldest first, and stops at the first it
/// keeps.
fn remember_idempotency_key(
    tx: &mut dyn StateTx,
    key: &str,
    text_sha256: &str,
    message_id: &str,
    events_after: Option<i64>,
) -> Result<(), RpcError> {
    let now = tx.now();
    let newest = tx.read_map(
        IDEMPOTENCY_KEY_ORDER,
        &MapQuery {
            descending: true,
            limit: 1,
            ..MapQuery::default()
        },
    )?;
    let ordinal = match newest.first() {
        Some((order, _)) => parse_idempotency_ordinal(order)?.saturating_add(1),
        None => 1,
    };
    let record = IdempotencyRecord {
        at: now,
        ordinal,
        text_sha256: text_sha256.to_string(),
        message_id: Some(message_id.to_string()),
        events_after,
    };
    tx.set(
        IDEMPOTENCY_KEYS,
        key,
        to_json("an idempotency key", &record)?,
    )?;
    tx.set(
        IDEMPOTENCY_KEY_ORDER,
        &idempotency_ordinal_key(ordinal),
        Json::String(key.to_string()),
    )?;
    let oldest = tx.read_map(
        IDEMPOTENCY_KEY_ORDER,
        &MapQuery {
            limit: IDEMPOTENCY_PRUNE_BATCH,
            ..MapQuery::default()
        },
    )?;
    for (order, value) in oldest {
        let n = parse_idempotency_ordinal(&order)?;
        if n >= ordinal {
            break;
        }
        let old_key: String = decode(&format!("idempotency key {order}"), value.value)?;
        let record: Option<IdempotencyRecord> = match tx.get(IDEMPOTENCY_KEYS, &old_key)? {
            Some(value) => Some(decode(&format!("idempotency key {order}"), value.value)?),
            None => None,
        };
        // The key's record belongs to this ordinal unless the key was
        // recorded again since (it is then younger, and stays).
        let owned = record.filter(|r| r.ordinal == n);
        let over_cap = ordinal - n >= MAX_IDEMPOTENCY_KEYS;
        let expired = owned
            .as_ref()
            .is_none_or(|r| now.saturating_sub(r.at) >= IDEMPOTENCY_KEY_RETENTION_MS);
        if !over_cap && !expired {
            break;
        }
        tx.delete(IDEMPOTENCY_KEY_ORDER, &order)?;
        if owned.is_some() {
            tx.delete(IDEMPOTENCY_KEYS, &old_key)?;
        }
    }
    Ok(())
}

/// Reads a session's messages with `query`, decoded.
fn messages(tx: &mut dyn StateTx, query: &MapQuery) -> Result<Vec<AgentMessage>, RpcError> {
    tx.read_map(AGENT_MESSAGES, query)?
        .into_iter()
        .map(|(key, value)| decode(&format!("message {key}"), value.value))
        .collect()
}

fn snapshot(tx: &mut dyn StateTx, session_id: &str) -> Result<Option<AgentSnapshot>, RpcError> {
    let Some(flow) = tx.flow()? else {
        return Ok(None);
    };
    let state: Option<AgentState> = match tx.get(AGENT_STATE, "")? {
        Some(value) => Some(decode("the session state", value.value)?),
        None => None,
    };
    let mut recent = messages(
        tx,
        &MapQuery {
            descending: true,
            limit: SNAPSHOT_MESSAGES,
            ..MapQuery::default()
        },
    )?;
    recent.reverse();
    let pending_interrupts = tx
        .read_map(PENDING_INTERRUPTS, &MapQuery::default())?
        .into_iter()
        .map(|(key, value)| decode::<AgentInterrupt>(&format!("interrupt {key}"), value.value))
        .collect::<Result<Vec<_>, _>>()?;
    let mut tool_calls = tx
        .read_map(AGENT_TOOL_CALLS, &MapQuery::default())?
        .into_iter()
        .map(|(key, value)| decode::<AgentToolCall>(&format!("tool call {key}"), value.value))
        .collect::<Result<Vec<_>, _>>()?;
    tool_calls.sort_by_key(|r| r.deferral_order);
    let usage = match tx.get(AGENT_USAGE, "")? {
        Some(value) => decode("the session usage", value.value)?,
        None => AgentUsage::default(),
    };
    let queued_message_count = tx.channel_len(QUEUED_USER_MESSAGES, "")?;
    Ok(Some(AgentSnapshot {
        session_id: session_id.to_string(),
        agent: flow.flow_type.clone(),
        flow_status: flow.status,
        state,
        messages: recent,
        pending_interrupts,
        tool_calls,
        usage,
        queued_message_count,
    }))
}

impl AgentSessionClient {
    pub fn new(client: FlowClient, flow_type: impl Into<String>) -> Self {
        Self {
            client,
            flow_type: flow_type.into(),
            max_user_message_bytes: MAX_USER_MESSAGE_BYTES,
        }
    }

    /// Sets the largest user message (bytes of UTF-8) this client queues or
    /// starts a session with; [`MAX_USER_MESSAGE_BYTES`] by default. Keep it
    /// within what the agent's runner can return from `build-user-message`
    /// under its output cap (see [`MAX_USER_MESSAGE_BYTES`]).
    pub fn with_max_user_message_bytes(mut self, bytes: usize) -> Self {
        self.max_user_message_bytes = bytes;
        self
    }

    /// The largest user message this client queues, in bytes.
    pub fn max_user_message_bytes(&self) -> usize {
        self.max_user_message_bytes
    }

    /// Refuses a user message over the cap, before anything is queued: one
    /// that `build-user-message` could not carry would fail its turn.
    fn check_user_message(&self, text: &str) -> Result<(), SessionError> {
        if text.len() > self.max_user_message_bytes {
            return Err(SessionError::MessageTooLarge {
                bytes: text.len(),
                limit: self.max_user_message_bytes,
            });
        }
        Ok(())
    }

    pub fn flow_type(&self) -> &str {
        &self.flow_type
    }

    pub fn flow_client(&self) -> &FlowClient {
        &self.client
    }

    /// Starts session `session_id`; a non-blank `initial_message` starts its
    /// first turn. An initial message over the cap is refused
    /// ([`SessionError::MessageTooLarge`]) and no session is created.
    pub async fn start_session(
        &self,
        session_id: &str,
        initial_message: &str,
    ) -> Result<(), SessionError> {
        self.start_traced(session_id, initial_message, TurnTrace::new_root())
            .await
    }

    /// [`start_session`](Self::start_session), with the trace of the turn
    /// the initial message starts (see [`TurnTrace::from_headers`]).
    pub async fn start_traced(
        &self,
        session_id: &str,
        initial_message: &str,
        trace: TurnTrace,
    ) -> Result<(), SessionError> {
        self.check_user_message(initial_message)?;
        let input = AgentSessionStartInput {
            initial_message: Some(initial_message.to_string()),
            initial_trace: Some(trace),
        };
        let input =
            serde_json::to_value(input).map_err(|err| RpcError::Rejected(err.to_string()))?;
        self.client
            .start_flow(&self.flow_type, session_id, input)
            .await?;
        Ok(())
    }

    /// Queues a user message; false for blank text (nothing is queued). A
    /// message over the cap is refused ([`SessionError::MessageTooLarge`]).
    pub async fn send_user_message(
        &self,
        session_id: &str,
        text: &str,
    ) -> Result<bool, SessionError> {
        let outcome = self
            .send_user_message_with_key(session_id, text, None)
            .await?;
        Ok(outcome == SendOutcome::Queued)
    }

    /// Queues a user message, at most once per `idempotency_key`: a send
    /// retried with the key of a message this session already queued (a
    /// client that timed out and tries again) queues nothing and answers
    /// [`SendOutcome::Replayed`]; the same key with another text is refused
    /// ([`SessionError::IdempotencyKeyReused`]). The key is recorded in the
    /// session's state ([`IDEMPOTENCY_KEYS`]) in the transaction that queues
    /// the message, so the rule holds across processes and restarts; a
    /// session remembers its keys for at least
    /// [`IDEMPOTENCY_KEY_RETENTION_MS`] (24 h), and at most its
    /// [`MAX_IDEMPOTENCY_KEYS`] newest. A repeat is recognised even after
    /// the session stopped. Blank text queues nothing ([`SendOutcome::Blank`])
    /// and records no key.
    pub async fn send_user_message_with_key(
        &self,
        session_id: &str,
        text: &str,
        idempotency_key: Option<&str>,
    ) -> Result<SendOutcome, SessionError> {
        Ok(self
            .send_tracked(session_id, text, idempotency_key, false)
            .await?
            .outcome)
    }

    /// [`send_user_message_with_key`](Self::send_user_message_with_key),
    /// answering with the queued message's id too: the `turn_started` event
    /// of the turn it starts carries it (see [`Self::wait_for_turn`]). A
    /// replay answers with the first send's id (none for a key recorded
    /// before ids were given).
    ///
    /// With `interrupt`, a running turn is cancelled and this message starts
    /// the next one, ahead of the queue (see [`Self::cancel_turn`]); with no
    /// turn running it is queued as usual.
    pub async fn send_tracked(
        &self,
        session_id: &str,
        text: &str,
        idempotency_key: Option<&str>,
        interrupt: bool,
    ) -> Result<Sent, SessionError> {
        self.send_traced(
            session_id,
            text,
            idempotency_key,
            interrupt,
            TurnTrace::new_root(),
            None,
        )
        .await
    }

    /// [`send_tracked`](Self::send_tracked), with the trace of the turn the
    /// message starts (see [`TurnTrace::from_headers`]) and, for a sender
    /// that will wait for that turn, the session's newest event before the
    /// send ([`Self::event_head`]): remembered with the idempotency key, so
    /// that a retry's wait starts there too.
    pub async fn send_traced(
        &self,
        session_id: &str,
        text: &str,
        idempotency_key: Option<&str>,
        interrupt: bool,
        trace: TurnTrace,
        events_after: Option<i64>,
    ) -> Result<Sent, SessionError> {
        if let Some(key) = idempotency_key {
            check_idempotency_key(key)?;
        }
        self.check_user_message(text)?;
        if text.trim().is_empty() {
            return Ok(Sent {
                outcome: SendOutcome::Blank,
                message_id: None,
                interrupted: None,
                events_after: None,
            });
        }
        let message_id = new_session_id("msg");
        let user = AgentUserMessage {
            text: text.to_string(),
            requeued: 0,
            message_id: Some(message_id.clone()),
            trace: Some(trace),
        };
        let message =
            serde_json::to_value(&user).map_err(|err| RpcError::Rejected(err.to_string()))?;
        let registry = self.client.registry().clone();
        let key = idempotency_key.map(|key| {
            (
                key.to_string(),
                hex::encode(Sha256::digest(text.as_bytes())),
            )
        });
        let id = session_id.to_string();
        // A plain send of a short message publishes it and remembers one
        // key: small enough to skip the store's writer thread. Its size is
        // the stored JSON's (escapes make a text longer). A steer takes the
        // running turn's tasks, which is not small.
        // (The text alone decides first: a longer one is never small, and
        // is not serialized a second time to learn so.)
        let small = !interrupt
            && text.len() <= SMALL_SEND_BYTES
            && message.to_string().len() <= SMALL_SEND_BYTES;
        let send = move |tx: &mut dyn StateTx| {
            let Some(flow) = tx.flow()? else {
                return Ok(Err(SessionError::NoSuchSession(id.clone())));
            };
            // A retry gets the first answer, whatever happened since.
            if let Some((key, text_sha256)) = &key {
                if let Some(seen) = tx.get(IDEMPOTENCY_KEYS, key)? {
                    let seen: IdempotencyRecord = decode("an idempotency key", seen.value)?;
                    if seen.text_sha256 != *text_sha256 {
                        return Ok(Err(SessionError::IdempotencyKeyReused {
                            session_id: id.clone(),
                            key: key.clone(),
                        }));
                    }
                    return Ok(Ok(Sent {
                        outcome: SendOutcome::Replayed,
                        message_id: seen.message_id,
                        interrupted: None,
                        events_after: seen.events_after,
                    }));
                }
            }
            if flow.status != FlowStatus::Running {
                return Ok(Err(SessionError::NotRunning {
                    session_id: id.clone(),
                    status: flow.status.as_str().to_string(),
                }));
            }
            let running = if interrupt {
                super::cancel::active_turn(tx)?
            } else {
                None
            };
            match &running {
                Some(turn) => {
                    if let Err(err) =
                        super::cancel::take_turn(tx, &registry, turn, Some(user.clone()))?
                    {
                        return Ok(Err(err.for_session(&id)));
                    }
                }
                None => tx.publish(QUEUED_USER_MESSAGES, "", message.clone())?,
            }
            if let Some((key, text_sha256)) = &key {
                remember_idempotency_key(tx, key, text_sha256, &message_id, events_after)?;
            }
            Ok(Ok(Sent {
                outcome: SendOutcome::Queued,
                message_id: Some(message_id.clone()),
                interrupted: running,
                events_after: None,
            }))
        };
        let outcome = if small {
            self.client.rpc_small(session_id, send).await?
        } else {
            self.client.rpc(session_id, send).await?
        };
        outcome
    }

    /// Answers a pending interrupt. False when it is no longer pending
    /// (already answered or expired), past its deadline, or the session is
    /// not running; [`SessionError::NoSuchInterrupt`] when the session never
    /// raised it. Lock conflicts with a running approval Step are retried
    /// for up to 5 s.
    pub async fn resolve_interrupt(
        &self,
        session_id: &str,
        request: ResolveInterruptRequest,
    ) -> Result<bool, SessionError> {
        let interrupt_id = request.interrupt_id.clone();
        let resolved = self
            .client
            .rpc(session_id, move |tx| {
                let id = &request.interrupt_id;
                // Pending, or raised before: a session stored before
                // RAISED_INTERRUPTS existed still has its pending ones.
                let known = |tx: &mut dyn StateTx| -> Result<Resolution, RpcError> {
                    let raised = tx.get(PENDING_INTERRUPTS, id)?.is_some()
                        || tx.get(RAISED_INTERRUPTS, id)?.is_some();
                    Ok(if raised {
                        Resolution::NotPending
                    } else {
                        Resolution::Unknown
                    })
                };
                match tx.flow()? {
                    Some(flow) if flow.status == FlowStatus::Running => {}
                    Some(_) => return known(tx),
                    None => return Ok(Resolution::Unknown),
                }
                tx.lock(PENDING_INTERRUPTS)?;
                let Some(value) = tx.get(PENDING_INTERRUPTS, id)? else {
                    return known(tx);
                };
                let interrupt: AgentInterrupt = decode("a pending interrupt", value.value)?;
                if interrupt.deadline.is_some_and(|at| tx.now() >= at) {
                    return Ok(Resolution::NotPending);
                }
                let answer = AgentInterruptResolution {
                    approved: request.approved,
                    // An approval carries no rejection message.
                    rejection_message: if request.approved {
                        None
                    } else {
                        request.rejection_message.clone()
                    },
                };
                tx.delete(PENDING_INTERRUPTS, &request.interrupt_id)?;
                tx.publish(
                    INTERRUPT_RESOLUTIONS,
                    &request.interrupt_id,
                    to_json("an interrupt resolution", &answer)?,
                )?;
                Ok(Resolution::Resolved)
            })
            .await?;
        match resolved {
            Resolution::Resolved => Ok(true),
            Resolution::NotPending => Ok(false),
            Resolution::Unknown => Err(SessionError::NoSuchInterrupt {
                session_id: session_id.to_string(),
                interrupt_id,
            }),
        }
    }

    /// The session as a UI draws it. Stopped sessions are served too. A
    /// read-only snapshot: it never waits for the store's writer.
    pub async fn get_agent_snapshot(
        &self,
        session_id: &str,
    ) -> Result<AgentSnapshot, SessionError> {
        let id = session_id.to_string();
        self.client
            .read_rpc(session_id, move |tx| snapshot(tx, &id))
            .await?
            .ok_or_else(|| SessionError::NoSuchSession(session_id.to_string()))
    }

    /// Messages oldest first, after `after_sequence`; the limit is clamped to
    /// 1..=200. Read-only, like the snapshot.
    pub async fn list_agent_messages(
        &self,
        session_id: &str,
        request: ListAgentMessagesRequest,
    ) -> Result<AgentMessagesPage, SessionError> {
        let limit = request.limit.clamp(1, MAX_MESSAGE_PAGE) as usize;
        let page = self
            .client
            .read_rpc(session_id, move |tx| {
                if tx.flow()?.is_none() {
                    return Ok(None);
                }
                // One extra row tells whether another page follows.
                let mut rows = messages(
                    tx,
                    &MapQuery {
                        after: request.after_sequence.map(message_sequence_key),
                        limit: limit + 1,
                        ..MapQuery::default()
                    },
                )?;
                let more = rows.len() > limit;
                rows.truncate(limit);
                let next_after_sequence = if more {
                    rows.last().map(|m| m.sequence)
                } else {
                    None
                };
                Ok(Some(AgentMessagesPage {
                    messages: rows,
                    next_after_sequence,
                }))
            })
            .await?;
        page.ok_or_else(|| SessionError::NoSuchSession(session_id.to_string()))
    }

    /// Stops the session; its state stays readable. False when it was not
    /// running.
    pub async fn stop_session(&self, session_id: &str) -> Result<bool, SessionError> {
        Ok(self.client.stop_flow(session_id).await?)
    }

    /// Events after stream sequence `after_seq`, oldest first, with their
    /// sequence numbers, and the sequence the next event will get.
    /// Woken when events are appended to `session_id`'s stream, if the
    /// store can say so (see [`crate::flow::FlowStore::stream_signal`]).
    pub fn event_signal(&self, session_id: &str) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        self.client.store().stream_signal(session_id)
    }

    /// How many times the session's readers were woken by a stop or a
    /// cancel (see [`crate::flow::FlowStore::stream_stops`]).
    pub fn event_stops(&self, session_id: &str) -> u64 {
        self.client.store().stream_stops(session_id)
    }

    pub async fn read_events(
        &self,
        session_id: &str,
        after_seq: i64,
        limit: usize,
    ) -> Result<(Vec<(i64, AgentEvent)>, i64), SessionError> {
        let page = self
            .client
            .read_stream(session_id, AGENT_EVENTS, after_seq, limit)
            .await?;
        let mut events = Vec::with_capacity(page.entries.len());
        for entry in page.entries {
            match serde_json::from_value::<AgentEvent>(entry.payload) {
                Ok(event) => events.push((entry.seq, event)),
                Err(err) => {
                    tracing::warn!(session_id, seq = entry.seq, error = %err, "skipping an unreadable event")
                }
            }
        }
        Ok((events, page.next_seq))
    }
}

/// A fresh session id, `<prefix>-<millis>-<pid><n>`: distinct across
/// processes and within one.
pub fn new_session_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{millis:x}-{:x}{n}", std::process::id())
}
