// The runner's own message format, apart from the component's bindings, so
// that `node --test` runs it without building the component.
//
// An item is a model message as JSON: the `frameworkItem` this runner
// stores, so a later turn replays the conversation exactly, tool calls
// included.

export function item(role, content, toolCalls, toolCallId) {
  const out = { role, content: content ?? null };
  if (toolCalls && toolCalls.length > 0) {
    out.tool_calls = toolCalls;
  }
  if (toolCallId !== undefined) {
    out.tool_call_id = toolCallId;
  }
  return out;
}

const ROLES = ["system", "user", "assistant", "tool"];

const isOptionalString = (value) => value === undefined || value === null || typeof value === "string";

// Whether parsed JSON has this runner's item shape.
export function isItem(parsed) {
  if (parsed === null || typeof parsed !== "object" || !ROLES.includes(parsed.role)) {
    return false;
  }
  if (!isOptionalString(parsed.content) || !isOptionalString(parsed.tool_call_id)) {
    return false;
  }
  const calls = parsed.tool_calls ?? [];
  return (
    Array.isArray(calls) &&
    calls.every(
      (c) => c !== null && typeof c === "object" && ["id", "name", "arguments"].every((k) => typeof c[k] === "string"),
    )
  );
}

// A stored message back as an item. A message this runner did not write
// (the host's turn-failure note, an imported history) is taken by its role
// and text.
export function stored(frameworkItem, role, text) {
  try {
    const parsed = JSON.parse(frameworkItem);
    if (isItem(parsed)) {
      return parsed;
    }
  } catch {
    // not this runner's item
  }
  return item(role, text);
}

// The run state this runner wrote, or a fresh one; throws for one it did
// not write.
export function runState(text) {
  if (text === undefined) {
    return { items: [], pending: [] };
  }
  const state = JSON.parse(text);
  const valid =
    state !== null &&
    typeof state === "object" &&
    Array.isArray(state.items) &&
    state.items.every(isItem) &&
    Array.isArray(state.pending) &&
    state.pending.every((p) => typeof p === "string");
  if (!valid) {
    throw new Error("not this runner's run state");
  }
  return state;
}

// The messages a model may be sent: a tool result whose call is not among
// them (cut off by the window) is dropped, since a model API refuses one.
export function window(items) {
  const announced = new Set();
  const kept = [];
  for (const it of items) {
    if (it.role === "tool" && !announced.has(it.tool_call_id)) {
      continue;
    }
    for (const call of it.tool_calls ?? []) {
      announced.add(call.id);
    }
    kept.push(it);
  }
  return kept;
}
