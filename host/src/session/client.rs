//! AgentSessionClient: the session's RPCs, each one transaction on the store.

use crate::flow::{FlowClient, FlowError, FlowStatus, MapQuery, RpcError, StateTx, StoreError};

use super::records::*;

/// Why a session call failed.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("session {0:?} does not exist")]
    NoSuchSession(String),
    #[error("session {session_id:?} is {status}; it takes no more messages")]
    NotRunning { session_id: String, status: String },
    #[error(transparent)]
    Flow(#[from] FlowError),
    #[error(transparent)]
    Rpc(#[from] RpcError),
}

/// Runs the session RPCs of one agent (flow type).
#[derive(Clone)]
pub struct AgentSessionClient {
    client: FlowClient,
    flow_type: String,
}

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
        }
    }

    pub fn flow_type(&self) -> &str {
        &self.flow_type
    }

    pub fn flow_client(&self) -> &FlowClient {
        &self.client
    }

    /// Starts session `session_id`; a non-blank `initial_message` starts its
    /// first turn.
    pub async fn start_session(
        &self,
        session_id: &str,
        initial_message: &str,
    ) -> Result<(), SessionError> {
        let input = AgentSessionStartInput {
            initial_message: Some(initial_message.to_string()),
        };
        let input =
            serde_json::to_value(input).map_err(|err| RpcError::Rejected(err.to_string()))?;
        self.client
            .start_flow(&self.flow_type, session_id, input)
            .await?;
        Ok(())
    }

    /// Queues a user message; false for blank text (nothing is queued).
    pub async fn send_user_message(
        &self,
        session_id: &str,
        text: &str,
    ) -> Result<bool, SessionError> {
        if text.trim().is_empty() {
            return Ok(false);
        }
        let message = serde_json::to_value(AgentUserMessage {
            text: text.to_string(),
        })
        .map_err(|err| RpcError::Rejected(err.to_string()))?;
        let id = session_id.to_string();
        let outcome = self
            .client
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
                tx.publish(QUEUED_USER_MESSAGES, "", message.clone())?;
                Ok(Ok(true))
            })
            .await?;
        outcome
    }

    /// Answers a pending interrupt. False when it is not pending (already
    /// answered, expired, or unknown) or past its deadline. Lock conflicts
    /// with a running approval Step are retried for up to 5 s.
    pub async fn resolve_interrupt(
        &self,
        session_id: &str,
        request: ResolveInterruptRequest,
    ) -> Result<bool, SessionError> {
        let resolved = self
            .client
            .rpc(session_id, move |tx| {
                match tx.flow()? {
                    Some(flow) if flow.status == FlowStatus::Running => {}
                    _ => return Ok(false),
                }
                tx.lock(PENDING_INTERRUPTS)?;
                let Some(value) = tx.get(PENDING_INTERRUPTS, &request.interrupt_id)? else {
                    return Ok(false);
                };
                let interrupt: AgentInterrupt = decode("a pending interrupt", value.value)?;
                if interrupt.deadline.is_some_and(|at| tx.now() >= at) {
                    return Ok(false);
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
                Ok(true)
            })
            .await?;
        Ok(resolved)
    }

    /// The session as a UI draws it. Stopped sessions are served too.
    pub async fn get_agent_snapshot(
        &self,
        session_id: &str,
    ) -> Result<AgentSnapshot, SessionError> {
        let id = session_id.to_string();
        self.client
            .rpc_once(session_id, move |tx| snapshot(tx, &id))
            .await?
            .ok_or_else(|| SessionError::NoSuchSession(session_id.to_string()))
    }

    /// Messages oldest first, after `after_sequence`; the limit is clamped to
    /// 1..=200.
    pub async fn list_agent_messages(
        &self,
        session_id: &str,
        request: ListAgentMessagesRequest,
    ) -> Result<AgentMessagesPage, SessionError> {
        let limit = request.limit.clamp(1, MAX_MESSAGE_PAGE) as usize;
        let page = self
            .client
            .rpc_once(session_id, move |tx| {
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
