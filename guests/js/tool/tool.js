// `js-tool`: a tool component written in JavaScript (componentize-js).
//
// It serves the same scenarios as the Rust `echo-tool` and the Python
// `py-tool`, so the tests run every language through one set of sessions:
//
// - `js_echo` (read): returns its arguments;
// - `js_describe_call` (read): the call as the tool saw it, idempotency key
//   included;
// - `js_word_count` (read): counts the words of {"text": ...}, writes an
//   event, and reads the optional `greeting` config key;
// - `js_fail`: a `tool-error.execution`, recorded as `failed` without a retry;
// - `js_raise`: throws an unexpected error. `call` turns it into
//   `tool-error.internal`, which the host retries as the effect allows.
//
// The bindings follow jco's conventions: exported functions in camelCase,
// records as objects with camelCase fields, enums as their WIT names
// ("read"), option<T> as the value or undefined, variants as {tag, val},
// u64 as BigInt. A `result` error is thrown as the error value itself.
//
// Every call runs in a fresh instance: nothing here survives between calls.

import { get } from "dex:agents/config@0.2.0";
import { writeEvent } from "dex:agents/events@0.2.0";
import { heartbeat } from "dex:agents/step@0.2.0";

const LANGUAGE = "javascript";
const OBJECT_SCHEMA = '{"type":"object"}';
const TEXT_SCHEMA =
  '{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}';

// A failure the model should see (`tool-error.execution`).
class ExecutionError extends Error {}

function wordCount(call) {
  let text;
  try {
    text = JSON.parse(call.toolCall.arguments).text;
  } catch (err) {
    throw new ExecutionError(`expected {"text": "..."}: ${err}`);
  }
  if (typeof text !== "string") {
    throw new ExecutionError('"text" must be a string');
  }
  heartbeat();
  const words = text.split(/\s+/).filter((w) => w.length > 0).length;
  writeEvent("js_word_count.counted", JSON.stringify({ words }));
  const result = { words };
  const greeting = get("greeting");
  if (greeting !== undefined) {
    result.greeting = greeting;
  }
  return JSON.stringify(result);
}

// name -> [description, parameters schema, declared effect, handler]
const TOOLS = {
  js_echo: ["Returns its arguments.", OBJECT_SCHEMA, "read", (call) => call.toolCall.arguments],
  js_describe_call: [
    "Returns the call as the tool saw it.",
    OBJECT_SCHEMA,
    "read",
    (call) =>
      JSON.stringify({
        language: LANGUAGE,
        flow_id: call.flowId,
        turn_id: call.turnId,
        tool_call_id: call.toolCall.toolCallId,
        idempotency_key: call.idempotencyKey,
        attempt: call.attempt,
        arguments: call.toolCall.arguments,
      }),
  ],
  js_word_count: ["Counts the words of a text.", TEXT_SCHEMA, "read", wordCount],
  js_fail: [
    "Fails with an error the model sees.",
    OBJECT_SCHEMA,
    "read",
    (call) => {
      throw new ExecutionError(`${LANGUAGE}-tool refused: ${call.toolCall.arguments}`);
    },
  ],
  js_raise: [
    "Throws an unexpected error.",
    OBJECT_SCHEMA,
    "read",
    () => {
      throw new TypeError(`${LANGUAGE}-tool threw on purpose`);
    },
  ],
};

export function listTools() {
  return Object.entries(TOOLS).map(([name, [description, parametersSchema, effect]]) => ({
    name,
    description,
    parametersSchema,
    effect,
  }));
}

export function call(call) {
  const name = call.toolCall.toolName;
  const entry = TOOLS[name];
  if (entry === undefined) {
    throw { tag: "execution", val: `${LANGUAGE}-tool serves no tool ${JSON.stringify(name)}` };
  }
  try {
    return entry[3](call);
  } catch (err) {
    if (err instanceof ExecutionError) {
      throw { tag: "execution", val: err.message };
    }
    // Anything else thrown out of `call` that is not a tool-error value traps
    // the instance. Report it as an internal error instead, with its stack,
    // so the host retries as the effect allows and records a readable error.
    // (SpiderMonkey's `stack` holds the frames only, not the message.)
    const detail = err instanceof Error ? `${err.name}: ${err.message}\n${err.stack}` : String(err);
    throw { tag: "internal", val: detail };
  }
}
