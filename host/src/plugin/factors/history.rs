//! `dex:agents/types.history`: the session's stored messages, which a runner
//! reads a page at a time instead of being handed all of them, so that a
//! runner that needs the newest 50 messages costs the same at 10 messages
//! and at 10,000.
//!
//! The plugin layer knows no store: a [`HistorySource`] (the session layer's
//! reader of committed state, or [`MemoryHistory`]) answers the pages. This
//! module clamps what a guest asks for and bounds what one call may read:
//! every page is a store round trip and host memory the guest's own memory
//! limit does not count until it is copied in.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use wasmtime::component::Resource;

use crate::plugin::bindings::runner::dex::agents::types;
use crate::plugin::bindings::wit::{
    AgentMessage, Compaction, HistoryOrder, ToolCallRecord, ToolSpec, TurnContext,
};
use crate::plugin::boundary::{BoundaryBytes, LIST_ITEM_BYTES};
use crate::plugin::call::CallState;

/// The most messages one `read` returns; a larger `limit` counts as this.
pub const MAX_PAGE: u32 = 500;
/// The most `read` calls one guest call may make.
pub const MAX_READS_PER_CALL: u32 = 1_000;
/// The most message bytes one guest call may read, over all its pages.
pub const MAX_BYTES_PER_CALL: u64 = 64 << 20;

/// What [`HistorySource::read`] returns.
pub type HistoryFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<AgentMessage>, String>> + Send + 'a>>;

/// Where a call's history comes from.
pub trait HistorySource: Send + Sync {
    /// How many messages there are: sequences run from 1 to this.
    fn length(&self) -> u64;

    /// The messages with `first <= sequence <= last`, at most `limit`,
    /// newest first when `newest_first`, stopping after the message that
    /// brings the page to `max_bytes` (a page is never empty for it). The
    /// caller has clamped the range to `1..=length()`, made it non-empty and
    /// bounded `limit` by [`MAX_PAGE`]. An error is the store's: the call then
    /// fails, and its Step is retried like any other.
    fn read(
        &self,
        first: u64,
        last: u64,
        newest_first: bool,
        limit: u32,
        max_bytes: u64,
    ) -> HistoryFuture<'_>;
}

/// A history held in memory, oldest first, sequences from 1. For calls made
/// outside a session (`dexa component call`, tests of a runner alone).
pub struct MemoryHistory {
    messages: Vec<AgentMessage>,
}

impl MemoryHistory {
    /// `messages[i]` must have sequence `i + 1`.
    pub fn shared(messages: Vec<AgentMessage>) -> Arc<dyn HistorySource> {
        Arc::new(Self { messages })
    }

    /// No messages.
    pub fn empty() -> Arc<dyn HistorySource> {
        Self::shared(Vec::new())
    }
}

impl HistorySource for MemoryHistory {
    fn length(&self) -> u64 {
        self.messages.len() as u64
    }

    fn read(
        &self,
        first: u64,
        last: u64,
        newest_first: bool,
        limit: u32,
        max_bytes: u64,
    ) -> HistoryFuture<'_> {
        let from = usize::try_from(first.saturating_sub(1)).unwrap_or(usize::MAX);
        let to = usize::try_from(last)
            .unwrap_or(usize::MAX)
            .min(self.messages.len());
        let slice = self.messages.get(from..to).unwrap_or(&[]);
        let ordered: Box<dyn Iterator<Item = &AgentMessage>> = if newest_first {
            Box::new(slice.iter().rev())
        } else {
            Box::new(slice.iter())
        };
        let mut page = Vec::new();
        let mut bytes = 0u64;
        for message in ordered.take(limit as usize) {
            if bytes >= max_bytes && !page.is_empty() {
                break;
            }
            bytes = bytes.saturating_add(message_bytes(message));
            page.push(message.clone());
        }
        Box::pin(async move { Ok(page) })
    }
}

/// A turn context before its history handle exists: only the call's own
/// store can make the handle, so the call adds it.
pub struct TurnInput {
    pub flow_id: String,
    pub turn_id: String,
    pub attempt: u32,
    pub history: Arc<dyn HistorySource>,
    pub compaction: Option<Compaction>,
    pub framework_run_state: Option<String>,
    pub tool_calls: Vec<ToolCallRecord>,
    pub tools: Vec<ToolSpec>,
}

impl TurnInput {
    /// Bytes of the context itself (the pages read later are counted apart).
    pub fn context_bytes(&self) -> usize {
        let records: usize = self.tool_calls.iter().fold(0, |sum, r| {
            sum.saturating_add(
                [&r.tool_call_id, &r.tool_name, &r.arguments]
                    .iter()
                    .map(|s| s.len())
                    .sum::<usize>(),
            )
            .saturating_add(r.output.boundary_bytes())
            .saturating_add(r.error.boundary_bytes())
            .saturating_add(r.rejection_message.boundary_bytes())
            .saturating_add(LIST_ITEM_BYTES)
        });
        let compaction = self
            .compaction
            .as_ref()
            .map_or(0, |c| c.summary.boundary_bytes() + c.turn_id.len());
        self.flow_id.len()
            + self.turn_id.len()
            + self.framework_run_state.boundary_bytes()
            + records
            + self.tools.boundary_bytes()
            + compaction
    }

    pub(crate) fn into_context(self, history: Resource<History>) -> TurnContext {
        TurnContext {
            flow_id: self.flow_id,
            turn_id: self.turn_id,
            attempt: self.attempt,
            history,
            compaction: self.compaction,
            framework_run_state: self.framework_run_state,
            tool_calls: self.tool_calls,
            tools: self.tools,
        }
    }
}

/// The host side of a `history` handle.
pub struct History {
    source: Arc<dyn HistorySource>,
}

impl History {
    pub(crate) fn new(source: Arc<dyn HistorySource>) -> Self {
        Self { source }
    }
}

/// What one call has read so far, against its budget.
#[derive(Default)]
pub(crate) struct HistoryBudget {
    reads: u32,
    bytes: u64,
}

/// Bytes of a stored message as the guest receives it.
fn message_bytes(message: &AgentMessage) -> u64 {
    (message.turn_id.len()
        + message.framework_item.len()
        + message.text.as_ref().map_or(0, String::len)
        + LIST_ITEM_BYTES) as u64
}

/// The part of `first..=last` inside `1..=length`, if any.
fn clamp(first: u64, last: u64, length: u64) -> Option<(u64, u64)> {
    let first = first.max(1);
    let last = last.min(length);
    (first <= last).then_some((first, last))
}

impl types::HostHistory for CallState {
    fn length(&mut self, this: Resource<History>) -> wasmtime::Result<u64> {
        Ok(self.table().get(&this)?.source.length())
    }

    async fn read(
        &mut self,
        this: Resource<History>,
        first: u64,
        last: u64,
        order: HistoryOrder,
        limit: u32,
    ) -> wasmtime::Result<Vec<AgentMessage>> {
        let source = self.table().get(&this)?.source.clone();
        let Some((first, last)) = clamp(first, last, source.length()) else {
            return Ok(Vec::new());
        };
        let limit = limit.min(MAX_PAGE);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let remaining = MAX_BYTES_PER_CALL.saturating_sub(self.history.bytes);
        if self.history.reads >= MAX_READS_PER_CALL || remaining == 0 {
            return Err(wasmtime::Error::msg(format!(
                "history.read was called more than {MAX_READS_PER_CALL} times in one call"
            )));
        }
        self.history.reads += 1;
        let newest_first = matches!(order, HistoryOrder::NewestFirst);
        let page = source
            .read(first, last, newest_first, limit, remaining)
            .await
            .map_err(|err| wasmtime::Error::msg(format!("history.read failed: {err}")))?;
        let bytes: u64 = page.iter().map(message_bytes).sum();
        self.history.bytes = self.history.bytes.saturating_add(bytes);
        if self.history.bytes > MAX_BYTES_PER_CALL {
            return Err(wasmtime::Error::msg(format!(
                "history.read returned more than {MAX_BYTES_PER_CALL} bytes in one call"
            )));
        }
        Ok(page)
    }

    fn drop(&mut self, this: Resource<History>) -> wasmtime::Result<()> {
        self.table().delete(this)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_clamped_to_the_stored_messages() {
        assert_eq!(clamp(0, 10, 5), Some((1, 5)));
        assert_eq!(clamp(3, 3, 5), Some((3, 3)));
        assert_eq!(clamp(6, 9, 5), None);
        assert_eq!(clamp(4, 2, 5), None);
        assert_eq!(clamp(0, u64::MAX, 0), None);
        assert_eq!(
            clamp(u64::MAX, u64::MAX, u64::MAX),
            Some((u64::MAX, u64::MAX))
        );
    }
}
