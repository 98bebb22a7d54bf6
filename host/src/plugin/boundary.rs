//! The size of what a guest hands back across the boundary, checked against
//! the component's caps once a call returns. The guest's own memory limit
//! bounds how much it can build; these caps bound what the host keeps,
//! stores and sends on.

use super::bindings::wit::{DeferredToolCall, FrameworkMessage, ToolError, ToolSpec, TurnOutcome};

/// Bytes of strings in a value returned by a guest.
pub(crate) trait BoundaryBytes {
    fn boundary_bytes(&self) -> usize;
}

impl BoundaryBytes for String {
    fn boundary_bytes(&self) -> usize {
        self.len()
    }
}

impl<T: BoundaryBytes> BoundaryBytes for Option<T> {
    fn boundary_bytes(&self) -> usize {
        self.as_ref().map_or(0, T::boundary_bytes)
    }
}

/// What each item of a returned list costs besides its strings: the host
/// stores every item as its own record (a row, a key, an envelope), so a
/// list of empty items is not free.
pub(crate) const LIST_ITEM_BYTES: usize = 64;

impl<T: BoundaryBytes> BoundaryBytes for Vec<T> {
    fn boundary_bytes(&self) -> usize {
        self.iter().fold(0usize, |sum, item| {
            sum.saturating_add(item.boundary_bytes())
                .saturating_add(LIST_ITEM_BYTES)
        })
    }
}

impl<T: BoundaryBytes, E: BoundaryBytes> BoundaryBytes for Result<T, E> {
    fn boundary_bytes(&self) -> usize {
        match self {
            Ok(value) => value.boundary_bytes(),
            Err(err) => err.boundary_bytes(),
        }
    }
}

impl BoundaryBytes for FrameworkMessage {
    fn boundary_bytes(&self) -> usize {
        self.framework_item
            .len()
            .saturating_add(self.text.boundary_bytes())
    }
}

impl BoundaryBytes for ToolError {
    fn boundary_bytes(&self) -> usize {
        match self {
            ToolError::Execution(message) | ToolError::Internal(message) => message.len(),
        }
    }
}

impl BoundaryBytes for ToolSpec {
    fn boundary_bytes(&self) -> usize {
        [&self.name, &self.description, &self.parameters_schema]
            .iter()
            .fold(0usize, |sum, s| sum.saturating_add(s.len()))
    }
}

impl BoundaryBytes for DeferredToolCall {
    fn boundary_bytes(&self) -> usize {
        [&self.tool_call_id, &self.tool_name, &self.arguments]
            .iter()
            .fold(0usize, |sum, s| sum.saturating_add(s.len()))
    }
}

/// The run state is measured on its own (it has its own cap); this counts
/// the rest of the outcome.
impl BoundaryBytes for TurnOutcome {
    fn boundary_bytes(&self) -> usize {
        match self {
            TurnOutcome::Completed(done) => done.new_messages.boundary_bytes(),
            TurnOutcome::ToolCallsRequested(request) => request.tool_calls.boundary_bytes(),
            TurnOutcome::Compacted(compacted) => compacted.summary.boundary_bytes(),
        }
    }
}

/// The framework run state an outcome carries, if any.
pub(crate) fn run_state_bytes(outcome: &Result<TurnOutcome, String>) -> usize {
    match outcome {
        Ok(TurnOutcome::ToolCallsRequested(request)) => request.framework_run_state.len(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::bindings::wit::MessageRole;

    #[test]
    fn a_list_of_empty_items_counts_its_items() {
        let empty = FrameworkMessage {
            role: MessageRole::Assistant,
            framework_item: String::new(),
            text: None,
        };
        let messages = vec![empty; 100_000];
        assert_eq!(messages.boundary_bytes(), 100_000 * LIST_ITEM_BYTES);
        assert!(
            messages.boundary_bytes() > 1 << 20,
            "over the default output cap"
        );
    }
}
