// What the tool computes, apart from the component's bindings, so that
// `node --test` runs it without building the component.

// The words (runs of non-whitespace), characters (code points, not UTF-16
// units) and lines of `text`.
export function stats(text) {
  return {
    words: text.split(/\s+/).filter((w) => w.length > 0).length,
    characters: [...text].length,
    lines: text.length === 0 ? 0 : text.replace(/\r?\n$/, "").split(/\r?\n/).length,
  };
}
