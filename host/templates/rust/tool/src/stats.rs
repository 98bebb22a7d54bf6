//! What the tool computes, apart from the component's bindings, so that
//! `cargo test` runs it natively.

use serde::Serialize;

/// The counts `__IDENT__` returns.
#[derive(Debug, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub words: usize,
    pub characters: usize,
    pub lines: usize,
}

/// Counts the words (runs of non-whitespace), characters (Unicode scalar
/// values, not bytes) and lines of `text`.
pub fn stats(text: &str) -> Stats {
    Stats {
        words: text.split_whitespace().count(),
        characters: text.chars().count(),
        lines: text.lines().count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_words_characters_and_lines() {
        assert_eq!(
            stats("the quick brown\nfox é"),
            Stats {
                words: 5,
                characters: 21,
                lines: 2
            }
        );
        assert_eq!(
            stats(""),
            Stats {
                words: 0,
                characters: 0,
                lines: 0
            }
        );
    }
}
