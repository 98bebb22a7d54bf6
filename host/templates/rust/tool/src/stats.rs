//! What the tool computes, apart from the component's bindings, so that
//! `cargo test` runs it natively. The Python and JavaScript templates count
//! the same way, and test the same cases.

use serde::Serialize;

/// The counts `__IDENT__` returns.
#[derive(Debug, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub words: usize,
    pub characters: usize,
    pub lines: usize,
}

/// Counts the words (runs of characters other than ASCII whitespace: space,
/// tab, line feed, vertical tab, form feed, carriage return), characters
/// (Unicode code points, not bytes) and lines (split at each `\n`, a last
/// `\n` ending the last line rather than starting another) of `text`.
pub fn stats(text: &str) -> Stats {
    Stats {
        words: text
            .split(|c: char| matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r'))
            .filter(|word| !word.is_empty())
            .count(),
        characters: text.chars().count(),
        lines: match text.matches('\n').count() {
            _ if text.is_empty() => 0,
            breaks if text.ends_with('\n') => breaks,
            breaks => breaks + 1,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_words_characters_and_lines() {
        // text, words, characters, lines
        let cases = [
            ("the quick brown\nfox é", 5, 21, 2),
            ("", 0, 0, 0),
            ("\n", 0, 1, 1),
            ("a\tb\r\nc\u{2028}d\n", 3, 9, 2),
            ("a\rb", 2, 3, 1),
            ("a\u{a0}b\n\n", 1, 5, 2),
        ];
        for (text, words, characters, lines) in cases {
            let expected = Stats {
                words,
                characters,
                lines,
            };
            assert_eq!(stats(text), expected, "{text:?}");
        }
    }
}
