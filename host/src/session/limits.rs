//! What one turn may cost, enforced by the host whatever the runner or the
//! model asks for, so that a model that fans out costs its own session and
//! never its neighbours, and so that what the host itself builds from a turn
//! (the next model step's input, the turn-failure note) always fits.

use serde::{Deserialize, Serialize};

/// The per-turn budget of an agent's sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnLimits {
    /// Tool calls one turn may defer, over all its model steps. A response
    /// that would go over fails the turn with that reason (recorded), before
    /// any of its calls runs.
    pub tool_calls: u32,
    /// Messages one completed turn may add.
    pub messages: u32,
    /// Bytes of tool output (and tool errors) one turn may keep. Each call
    /// is given its share of what is left when it is deferred; output past
    /// its share is cut, with a marker. The default leaves room, under a
    /// runner's default 1 MiB output and run-state caps, for a runner that
    /// carries every output of the turn into its next step and returns each
    /// twice when the turn completes (as its framework item and its text,
    /// as `chat-runner` does).
    pub tool_output_bytes: u64,
}

impl Default for TurnLimits {
    fn default() -> Self {
        Self {
            tool_calls: 256,
            messages: 1024,
            tool_output_bytes: 256 << 10,
        }
    }
}

/// How much of each tool call's outcome the turn-failure note quotes.
pub const NOTE_OUTCOME_BYTES: usize = 1024;
/// How much of each tool call's arguments the turn-failure note quotes.
pub const NOTE_ARGUMENTS_BYTES: usize = 256;
/// The longest turn-failure note; calls past it are counted, not listed.
pub const NOTE_BYTES: usize = 64 << 10;

/// The most of a failure's text a Step keeps (history, records,
/// `last_turn_error`).
pub const ERROR_TEXT_BYTES: usize = 16 << 10;

/// `text` cut to at most `limit` bytes (on a character boundary), with a
/// marker saying how much was cut and why; unchanged when it fits.
pub fn cut(text: &str, limit: usize, why: &str) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}[dexa: {} more bytes cut: {why}]",
        &text[..end],
        text.len() - end
    )
}

/// Each new call's share of what is left of the turn's tool-output budget.
pub fn output_share(limits: &TurnLimits, used: u64, new_calls: usize) -> u64 {
    let left = limits.tool_output_bytes.saturating_sub(used);
    left / (new_calls.max(1) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_keeps_whole_characters_and_says_what_it_cut() {
        assert_eq!(cut("short", 10, "why"), "short");
        let cut_text = cut("ééééé", 3, "the budget");
        assert_eq!(cut_text, "é[dexa: 8 more bytes cut: the budget]");
    }

    #[test]
    fn shares_never_add_up_past_the_budget() {
        let limits = TurnLimits::default();
        let mut used = 0;
        for batch in [1, 3, 200, 7, 1] {
            let share = output_share(&limits, used, batch);
            used += share * batch as u64;
            assert!(used <= limits.tool_output_bytes);
        }
    }
}
