import { test } from "node:test";
import assert from "node:assert/strict";

import { item, runState, stored, window } from "../src/conversation.js";

test("a tool result without its call in the window is dropped", () => {
  const call = item("assistant", null, [{ id: "b", name: "t", arguments: "{}" }]);
  const resultA = item("tool", "done", undefined, "a");
  const resultB = item("tool", "done", undefined, "b");
  assert.deepEqual(window([resultA, call, resultB]), [call, resultB]);
});

test("a message of another shape is read by its role and text", () => {
  assert.deepEqual(stored("not json", "user", "hello"), item("user", "hello"));
  for (const other of ['{"role": "robot"}', '{"role": "user", "content": [1]}', "[]", "null"]) {
    assert.deepEqual(stored(other, "user", "hello"), item("user", "hello"), other);
  }
});

test("a run state of another shape is refused", () => {
  assert.deepEqual(runState(undefined), { items: [], pending: [] });
  const state = { items: [item("tool", "done", undefined, "a")], pending: ["a"] };
  assert.deepEqual(runState(JSON.stringify(state)), state);
  for (const other of ["[]", "{}", '{"items": [], "pending": [1]}', "not json"]) {
    assert.throws(() => runState(other), undefined, other);
  }
});
