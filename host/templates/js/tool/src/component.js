// `__NAME__`: a tool component for dexa, in JavaScript (componentize-js).
//
// It serves one tool, `__IDENT__`, which counts the words, characters and
// lines of {"text": "..."}. Change `stats.js` and TOOLS below, then
// `./build.sh` (or `dexa build`) and try it:
//
//     dexa component call build/__NAME__.wasm __IDENT__ --args '{"text": "a b"}'
//
// Every call runs in a fresh instance that is dropped afterwards: keep no
// state between calls. The bindings follow jco's conventions: exports in
// camelCase, records as objects with camelCase fields, enums as their WIT
// names ("read"), option<T> as the value or undefined, variants as
// {tag, val}, u64 as BigInt; a `result` error is thrown as the value itself.
// The engine has no `Intl` and no `\p{...}` in regular expressions.

import { get } from "dex:agents/config@0.2.0";
import { heartbeat } from "dex:agents/step@0.2.0";

import { stats } from "./stats.js";

const SCHEMA = '{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}';

// A mistake the model should see (`tool-error.execution`).
class ExecutionError extends Error {}

function count(call) {
  // The model wrote the arguments: a mistake in them is an execution error,
  // which the model sees and may correct.
  let text;
  try {
    text = JSON.parse(call.toolCall.arguments).text;
  } catch (err) {
    throw new ExecutionError(`expected {"text": "..."}: ${err}`);
  }
  if (typeof text !== "string") {
    throw new ExecutionError('"text" must be a string');
  }
  // A long call tells the host it is alive.
  heartbeat();
  const answer = stats(text);
  // Config comes from dexa.toml or `dexa component call --config KEY=VALUE`.
  const note = get("note");
  if (note !== undefined) {
    answer.note = note;
  }
  return JSON.stringify(answer);
}

// name -> [description, parameters schema, declared effect, handler]
const TOOLS = {
  __IDENT__: ["Counts the words, characters and lines of a text.", SCHEMA, "read", count],
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
  const entry = TOOLS[call.toolCall.toolName];
  if (entry === undefined) {
    throw { tag: "execution", val: `__NAME__ serves no tool ${JSON.stringify(call.toolCall.toolName)}` };
  }
  try {
    return entry[3](call);
  } catch (err) {
    // Throw the tool-error value, never an Error: an Error thrown out of
    // `call` traps the instance.
    if (err instanceof ExecutionError) {
      throw { tag: "execution", val: err.message };
    }
    const detail = err instanceof Error ? `${err.name}: ${err.message}\n${err.stack}` : String(err);
    throw { tag: "internal", val: detail };
  }
}
