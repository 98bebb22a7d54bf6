//! Importing a conversation into an idle session: messages that happened
//! elsewhere (a migration from another system) or, for the long-session
//! benchmark and tests, thousands of messages without running thousands of
//! turns. They join the history as if turns had made them; the runner reads
//! them through its history handle like any other.

use super::cancel::running;
use super::client::{AgentSessionClient, SessionError};
use super::records::{
    message_sequence_key, AgentMessage, AgentState, MessageRole, SessionStatus, AGENT_MESSAGES,
    AGENT_STATE, QUEUED_USER_MESSAGES,
};
use crate::flow::{RpcError, StoreError};

/// The most messages one import adds: one transaction stays short.
pub const MAX_IMPORTED_MESSAGES: usize = 1_000;
/// The most bytes one imported message may carry (its item and its text).
pub const MAX_IMPORTED_MESSAGE_BYTES: usize = 256 << 10;
/// The most bytes one import may carry in all: one transaction holds the
/// store's writer (on SQLite, every session's) while it runs.
pub const MAX_IMPORT_BYTES: usize = 16 << 20;
/// The turn id imported messages carry: no turn of this session made them.
pub const IMPORTED_TURN_ID: &str = "imported";

/// One message to import.
#[derive(Clone, Debug)]
pub struct ImportedMessage {
    pub role: MessageRole,
    /// The runner's own item (for the chat runners, the model message as
    /// JSON); a runner that cannot read it falls back to role and text.
    pub framework_item: String,
    pub text: Option<String>,
}

fn corrupt(what: &str, err: serde_json::Error) -> RpcError {
    RpcError::Store(StoreError::Corrupt(format!("{what}: {err}")))
}

fn check(messages: &[ImportedMessage]) -> Result<(), SessionError> {
    if messages.len() > MAX_IMPORTED_MESSAGES {
        return Err(SessionError::Invalid(format!(
            "an import may add at most {MAX_IMPORTED_MESSAGES} messages, not {}",
            messages.len()
        )));
    }
    let mut total = 0usize;
    for (index, message) in messages.iter().enumerate() {
        let bytes = message.framework_item.len() + message.text.as_ref().map_or(0, String::len);
        if bytes > MAX_IMPORTED_MESSAGE_BYTES {
            return Err(SessionError::Invalid(format!(
                "imported message {index} is {bytes} bytes, over the limit of \
                 {MAX_IMPORTED_MESSAGE_BYTES}"
            )));
        }
        total += bytes;
    }
    if total > MAX_IMPORT_BYTES {
        return Err(SessionError::Invalid(format!(
            "the import is {total} bytes, over the limit of {MAX_IMPORT_BYTES}; import in parts"
        )));
    }
    Ok(())
}

impl AgentSessionClient {
    /// Appends `messages` to the history of an idle session (no turn
    /// running, no message queued), in one transaction, and answers the new
    /// message count. Everything or nothing is written. `expected_count` is
    /// the message count the caller saw: when the session holds another, the
    /// import is refused, so a retried import cannot add its messages twice.
    pub async fn import_messages(
        &self,
        session_id: &str,
        expected_count: u64,
        messages: Vec<ImportedMessage>,
    ) -> Result<u64, SessionError> {
        check(&messages)?;
        let id = session_id.to_string();
        self.flow_client()
            .rpc(session_id, move |tx| {
                if let Err(err) = running(tx, &id)? {
                    return Ok(Err(err));
                }
                // Race-free without a lock: RPCs of a session are serialized,
                // a queued message stays in the channel until the
                // AwaitUserMessage that takes it commits, and a turn is
                // active from that commit to its end.
                let Some(state) = tx.get(AGENT_STATE, "")? else {
                    return Ok(Err(SessionError::Busy {
                        session_id: id.clone(),
                        reason: "it has not started yet".to_string(),
                    }));
                };
                let mut state: AgentState = serde_json::from_value(state.value)
                    .map_err(|err| corrupt("the session state", err))?;
                if state.active_turn_id.is_some()
                    || state.status != SessionStatus::WaitingForUserMessage
                {
                    return Ok(Err(SessionError::Busy {
                        session_id: id.clone(),
                        reason: "a turn is running".to_string(),
                    }));
                }
                if state.message_count != expected_count {
                    return Ok(Err(SessionError::Busy {
                        session_id: id.clone(),
                        reason: format!(
                            "it holds {} messages, not the {expected_count} the import expected",
                            state.message_count
                        ),
                    }));
                }
                if tx.channel_len(QUEUED_USER_MESSAGES, "")? > 0 {
                    return Ok(Err(SessionError::Busy {
                        session_id: id.clone(),
                        reason: "messages wait for a turn".to_string(),
                    }));
                }
                for message in &messages {
                    state.message_count += 1;
                    let stored = AgentMessage {
                        sequence: state.message_count,
                        turn_id: IMPORTED_TURN_ID.to_string(),
                        role: message.role,
                        framework_item: message.framework_item.clone(),
                        text: message.text.clone(),
                    };
                    tx.set(
                        AGENT_MESSAGES,
                        &message_sequence_key(stored.sequence),
                        serde_json::to_value(&stored).map_err(|err| corrupt("a message", err))?,
                    )?;
                }
                tx.set(
                    AGENT_STATE,
                    "",
                    serde_json::to_value(&state).map_err(|err| corrupt("the state", err))?,
                )?;
                Ok(Ok(state.message_count))
            })
            .await?
    }
}
