//! The session's history as RunModel hands it to a runner: a reader of the
//! committed messages, one store read per page, and the compactions a runner
//! made. Nothing here loads the whole history, so a turn of a session with
//! 10,000 messages reads what its runner asks for and no more.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::event_data::ContextCost;
use super::records::{
    message_sequence_key, AgentMessage, MessageRole, AGENT_COMPACTIONS, AGENT_MESSAGES,
};
use crate::flow::{MapQuery, StateAnswer, StateQuery, StepContext};
use crate::plugin::factors::history::{HistoryFuture, HistorySource, MAX_PAGE};

/// History reads of guests running at once in this process, whatever their
/// sessions: each holds a store connection (on PostgreSQL, one of the
/// pool's) while it runs.
static HISTORY_READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);
use crate::plugin::wit;

/// A summary a runner made that stands for messages 1 through
/// `through_sequence`. The messages themselves stay stored and listable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AgentCompaction {
    pub through_sequence: u64,
    /// The turn that made it.
    pub turn_id: String,
    pub role: MessageRole,
    pub framework_item: String,
    pub text: Option<String>,
}

impl AgentCompaction {
    pub(crate) fn from_wit(turn_id: &str, compacted: &wit::HistoryCompacted) -> Self {
        Self {
            through_sequence: compacted.through_sequence,
            turn_id: turn_id.to_string(),
            role: compacted.summary.role.into(),
            framework_item: compacted.summary.framework_item.clone(),
            text: compacted.summary.text.clone(),
        }
    }

    pub(crate) fn to_wit(&self) -> wit::Compaction {
        wit::Compaction {
            through_sequence: self.through_sequence,
            summary: wit::FrameworkMessage {
                role: self.role.into(),
                framework_item: self.framework_item.clone(),
                text: self.text.clone(),
            },
            turn_id: self.turn_id.clone(),
        }
    }

    /// Its key in [`AGENT_COMPACTIONS`].
    pub(crate) fn key(&self) -> String {
        message_sequence_key(self.through_sequence)
    }
}

/// The query for the newest compaction.
pub(crate) fn newest_compaction_query() -> StateQuery {
    StateQuery::map(
        AGENT_COMPACTIONS,
        MapQuery {
            descending: true,
            limit: 1,
            ..MapQuery::default()
        },
    )
}

/// Why a `compacted` outcome is refused (the turn then fails): it must move
/// past the newest compaction, leave the newest message (the turn's own user
/// message: a turn appends its messages only when it completes) after the
/// summary, and be the turn's first, so that a runner cannot spend a turn
/// compacting in a loop.
pub fn check_compaction(
    through_sequence: u64,
    length: u64,
    newest: Option<&AgentCompaction>,
    turn_id: &str,
) -> Result<(), String> {
    if let Some(newest) = newest {
        if newest.turn_id == turn_id {
            return Err(format!(
                "the turn already compacted the history (through message {}); a turn may \
                 compact once",
                newest.through_sequence
            ));
        }
        if through_sequence <= newest.through_sequence {
            return Err(format!(
                "it compacts through message {through_sequence}, but the history is already \
                 compacted through message {}",
                newest.through_sequence
            ));
        }
    }
    if through_sequence == 0 || through_sequence >= length {
        return Err(format!(
            "it compacts through message {through_sequence}, but the history has {length} \
             message(s) and the newest (the turn's own) must stay after the summary"
        ));
    }
    Ok(())
}

/// What a runner's call read from the history, for the `usage_recorded`
/// event (and the benchmark's comparison of long and short sessions).
#[derive(Default)]
pub(crate) struct HistoryMeter {
    reads: AtomicU64,
    messages: AtomicU64,
    bytes: AtomicU64,
    micros: AtomicU64,
}

impl HistoryMeter {
    /// The figures, with the bytes of the context the call was handed.
    pub fn report(&self, context_bytes: usize, host_micros: u64) -> ContextCost {
        ContextCost {
            history_reads: self.reads.load(Ordering::Relaxed),
            messages_read: self.messages.load(Ordering::Relaxed),
            guest_input_bytes: context_bytes as u64 + self.bytes.load(Ordering::Relaxed),
            host_micros: host_micros + self.micros.load(Ordering::Relaxed),
        }
    }
}

/// The committed messages of the running Step's session, as RunModel saw
/// them when it began: `length` is the message count it read.
pub(crate) struct StoredHistory {
    ctx: StepContext,
    length: u64,
    pub meter: HistoryMeter,
}

impl StoredHistory {
    pub fn new(ctx: StepContext, length: u64) -> Self {
        Self {
            ctx,
            length,
            meter: HistoryMeter::default(),
        }
    }
}

impl HistorySource for StoredHistory {
    fn length(&self) -> u64 {
        self.length
    }

    fn read(
        &self,
        first: u64,
        last: u64,
        newest_first: bool,
        limit: u32,
        max_bytes: u64,
    ) -> HistoryFuture<'_> {
        Box::pin(async move {
            let started = Instant::now();
            let query = MapQuery {
                after: Some(message_sequence_key(first.saturating_sub(1))),
                before: Some(message_sequence_key(last.saturating_add(1))),
                descending: newest_first,
                // Never 0, which a map read takes as "no limit".
                limit: limit.clamp(1, MAX_PAGE) as usize,
                // The store stops at the budget before the rows reach the
                // host: a page holds at most the budget and one message.
                max_bytes: Some(max_bytes),
            };
            // Guests' reads share the store with commits and lease
            // renewals: only a few at a time per process.
            let _permit = HISTORY_READS
                .acquire()
                .await
                .map_err(|_| "the history reader is shutting down".to_string())?;
            let answer = self
                .ctx
                .read_state(vec![StateQuery::map(AGENT_MESSAGES, query)])
                .await
                .map_err(|err| err.to_string())?;
            let entries = match answer.into_iter().next() {
                Some(StateAnswer::Entries(entries)) => entries,
                _ => return Err("the store answered no entries for the history".to_string()),
            };
            let mut page = Vec::with_capacity(entries.len());
            let mut bytes = 0u64;
            for (key, versioned) in entries {
                let message: AgentMessage = serde_json::from_value(versioned.value)
                    .map_err(|err| format!("message {key} is unreadable: {err}"))?;
                bytes += (message.turn_id.len()
                    + message.framework_item.len()
                    + message.text.as_ref().map_or(0, String::len)) as u64;
                page.push(message.to_wit());
            }
            self.meter.reads.fetch_add(1, Ordering::Relaxed);
            self.meter
                .messages
                .fetch_add(page.len() as u64, Ordering::Relaxed);
            self.meter.bytes.fetch_add(bytes, Ordering::Relaxed);
            self.meter
                .micros
                .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
            Ok(page)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compaction(through: u64, turn: &str) -> AgentCompaction {
        AgentCompaction {
            through_sequence: through,
            turn_id: turn.to_string(),
            role: MessageRole::System,
            framework_item: "{}".to_string(),
            text: None,
        }
    }

    #[test]
    fn a_compaction_moves_forward_within_the_history_once_per_turn() {
        assert!(check_compaction(5, 10, None, "turn-3").is_ok());
        assert!(check_compaction(9, 10, None, "turn-3").is_ok());
        assert!(check_compaction(10, 10, None, "turn-3").is_err());
        assert!(check_compaction(1, 1, None, "turn-3").is_err());
        assert!(check_compaction(0, 10, None, "turn-3").is_err());
        assert!(check_compaction(11, 10, None, "turn-3").is_err());
        let earlier = compaction(5, "turn-2");
        assert!(check_compaction(6, 10, Some(&earlier), "turn-3").is_ok());
        assert!(check_compaction(5, 10, Some(&earlier), "turn-3").is_err());
        assert!(check_compaction(4, 10, Some(&earlier), "turn-3").is_err());
        let this_turn = compaction(5, "turn-3");
        assert!(check_compaction(8, 10, Some(&this_turn), "turn-3").is_err());
    }
}
