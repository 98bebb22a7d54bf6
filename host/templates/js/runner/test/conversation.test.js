import { test } from "node:test";
import assert from "node:assert/strict";

import { item, stored, window } from "../src/conversation.js";

test("a tool result without its call in the window is dropped", () => {
  const call = item("assistant", null, [{ id: "b", name: "t", arguments: "{}" }]);
  const resultA = item("tool", "done", undefined, "a");
  const resultB = item("tool", "done", undefined, "b");
  assert.deepEqual(window([resultA, call, resultB]), [call, resultB]);
});

test("a message of another shape is read by its role and text", () => {
  assert.deepEqual(stored("not json", "user", "hello"), item("user", "hello"));
});
