import { test } from "node:test";
import assert from "node:assert/strict";

import { stats } from "../src/stats.js";

// text, words, characters, lines: the same cases as the Rust and Python
// templates.
const CASES = [
  ["the quick brown\nfox é", 5, 21, 2],
  ["", 0, 0, 0],
  ["\n", 0, 1, 1],
  ["a\tb\r\nc\u2028d\n", 3, 9, 2],
  ["a\rb", 2, 3, 1],
  ["a\u00a0b\n\n", 1, 5, 2],
];

test("counts words, characters and lines", () => {
  for (const [text, words, characters, lines] of CASES) {
    assert.deepEqual(stats(text), { words, characters, lines }, JSON.stringify(text));
  }
});
