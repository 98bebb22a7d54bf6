// `__NAME__`: a runner component for dexa, in JavaScript (componentize-js):
// the plain agent loop.
//
// Each `runModelStep` sends the conversation and the session's tools to the
// host's model (`complete`). Tool calls in the answer become deferred tool
// calls, each its own durable Step on the host; the next `runModelStep`
// sends their outcomes back. An answer without tool calls ends the turn. Try
// it on the scripted model with the project's `dexa.toml`:
//
//     dexa demo -c dexa.toml --agent __NAME__ --message "Hello"
//
// Config keys: `system_prompt`, `history_window` (default 50, the newest
// messages the model sees).
//
// Every call runs in a fresh instance that is dropped afterwards: what a
// turn needs between its model calls travels in `frameworkRunState`. The
// bindings follow jco's conventions: records as objects with camelCase
// fields, enums as their WIT names, option<T> as the value or undefined,
// variants as {tag, val}, u64 as BigInt; a `result` error is thrown as the
// value itself, and an imported function's error arrives as a thrown error
// whose `payload` is the value.

import { get } from "dex:agents/config@0.2.0";
import { complete } from "dex:agents/model@0.2.0";
import { describeToolCallOutcome, resolveToolPolicy } from "dex:agents/policy@0.2.0";

import { item, runState, stored, window } from "./conversation.js";

function toModel(it) {
  return {
    role: it.role,
    content: it.content ?? undefined,
    toolCalls: (it.tool_calls ?? []).map((c) => ({ id: c.id, name: c.name, arguments: c.arguments })),
    toolCallId: it.tool_call_id ?? undefined,
  };
}

function frameworkMessage(it) {
  return { role: it.role, frameworkItem: JSON.stringify(it), text: it.content ?? undefined };
}

// The newest `history_window` stored messages, oldest first: one page read
// from the host, so a session of 10,000 messages costs what one of 50 does.
function history(turn) {
  const asked = Number.parseInt(get("history_window") ?? "50", 10);
  const size = Number.isNaN(asked) ? 50 : Math.min(Math.max(asked, 1), 500);
  const since = turn.compaction === undefined ? 0n : turn.compaction.throughSequence;
  const page = turn.history.read(since + 1n, turn.history.length(), "newest-first", size);
  return page.reverse().map((m) => stored(m.frameworkItem, m.role, m.text));
}

export function buildUserMessage(text) {
  return frameworkMessage(item("user", text));
}

export function runModelStep(turn) {
  // A thrown string fails this attempt; the host retries RunModel.
  let state;
  try {
    state = runState(turn.frameworkRunState);
  } catch (err) {
    throw `the run state is not __NAME__'s: ${err}`;
  }
  for (const id of state.pending) {
    const record = turn.toolCalls.find((r) => r.toolCallId === id);
    if (record === undefined) {
      throw `no record for tool call ${JSON.stringify(id)}`;
    }
    state.items.push(item("tool", describeToolCallOutcome(record), undefined, id));
  }
  state.pending = [];

  const messages = [];
  const prompt = get("system_prompt");
  if (prompt !== undefined && prompt.trim() !== "") {
    messages.push(toModel(item("system", prompt)));
  }
  if (turn.compaction !== undefined) {
    messages.push(toModel(item("system", turn.compaction.summary.text)));
  }
  messages.push(...window(history(turn)).map(toModel));
  messages.push(...state.items.map(toModel));
  let response;
  try {
    response = complete({ messages, tools: turn.tools });
  } catch (err) {
    throw `the model call failed: ${JSON.stringify(err.payload ?? String(err))}`;
  }

  const calls = response.message.toolCalls.map((c) => ({ id: c.id, name: c.name, arguments: c.arguments }));
  state.items.push(item("assistant", response.message.content, calls));
  if (calls.length === 0) {
    return {
      tag: "completed",
      val: { newMessages: state.items.map(frameworkMessage), usage: response.usage },
    };
  }
  const toolCalls = calls.map((c) => ({
    toolCallId: c.id,
    toolName: c.name,
    arguments: c.arguments,
    // The tool's declared effect is the framework's; the operator's policy
    // in dexa.toml still wins.
    policy: resolveToolPolicy(c.name, turn.tools.find((t) => t.name === c.name)?.effect),
  }));
  state.pending = calls.map((c) => c.id);
  return {
    tag: "tool-calls-requested",
    val: { frameworkRunState: JSON.stringify(state), toolCalls, usage: response.usage },
  };
}

export function executeDeferredToolCall(call) {
  // Tools served by tool components never come here; a runner that runs
  // tools of its framework in-process would.
  throw { tag: "execution", val: `__NAME__ runs no tools itself (${JSON.stringify(call.toolCall.toolName)})` };
}
