import { test } from "node:test";
import assert from "node:assert/strict";

import { stats } from "../src/stats.js";

test("counts words, characters and lines", () => {
  assert.deepEqual(stats("the quick brown\nfox é"), { words: 5, characters: 21, lines: 2 });
  assert.deepEqual(stats(""), { words: 0, characters: 0, lines: 0 });
});
