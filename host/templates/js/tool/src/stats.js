// What the tool computes, apart from the component's bindings, so that
// `node --test` runs it without building the component. The Rust and Python
// templates count the same way, and test the same cases.

// ASCII whitespace only: `\s` would also split at Unicode spaces, and count
// differently from the other languages.
const WHITESPACE = /[ \t\n\v\f\r]+/;

// The words (runs of characters other than ASCII whitespace), characters
// (code points, not UTF-16 units) and lines (split at each newline, a last
// one ending the last line rather than starting another) of `text`.
export function stats(text) {
  const breaks = text.split("\n").length - 1;
  return {
    words: text.split(WHITESPACE).filter((word) => word.length > 0).length,
    characters: [...text].length,
    lines: text.length === 0 ? 0 : text.endsWith("\n") ? breaks : breaks + 1,
  };
}
