// `js-hostile-tool`: a JavaScript tool that attacks its sandbox, for
// `tests/tests/hostile_languages.rs`. Each tool is one attack; nothing is
// caught, so a throw traps the instance as it would in careless code.
//
// - `js_spin`: an endless loop;
// - `js_memory_bomb`: allocates 1 MiB buffers until something gives;
// - `js_recurse`: unbounded recursion;
// - `js_big_output`: returns `megabytes` MiB of text;
// - `js_event_flood`: writes 13 MB of events, far over its budget;
// - `js_trap`: throws an Error that nothing catches.

import { writeEvent } from "dex:agents/events@0.2.0";

const TOOLS = ["js_spin", "js_memory_bomb", "js_recurse", "js_big_output", "js_event_flood", "js_trap"];

function recurse(depth) {
  return recurse(depth + 1) + 1;
}

export function listTools() {
  return TOOLS.map((name) => ({
    name,
    description: "A hostile attack.",
    parametersSchema: '{"type":"object"}',
    effect: "read",
  }));
}

export function call(call) {
  const args = JSON.parse(call.toolCall.arguments || "{}");
  switch (call.toolCall.toolName) {
    case "js_spin": {
      let n = 0;
      for (;;) {
        n += 1;
      }
    }
    case "js_memory_bomb": {
      const hoard = [];
      for (;;) {
        const block = new Uint8Array(1 << 20);
        block.fill(0xa5);
        hoard.push(block);
      }
    }
    case "js_recurse":
      return String(recurse(0));
    case "js_big_output":
      return "x".repeat(args.megabytes << 20);
    case "js_event_flood": {
      const payload = JSON.stringify({ pad: "y".repeat(65536) });
      for (let i = 0; i < 200; i++) {
        writeEvent("flood", payload);
      }
      return "flooded";
    }
    case "js_trap":
      throw new Error("js-hostile-tool throws on purpose");
    default:
      throw new Error(`no tool ${call.toolCall.toolName}`);
  }
}
