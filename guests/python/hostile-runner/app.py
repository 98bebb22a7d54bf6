"""`py-hostile-runner`: a Python runner that attacks its sandbox and the
session's rules, for `tests/tests/hostile_languages.rs`. The last user
message picks the attack; anything else completes the turn with `ok: <text>`.

- `spin`, `memory-bomb`, `trap-model` (an exception nothing catches);
- malformed outcomes: `empty-run-state`, `dup-ids`, `slash-ids`,
  `big-run-state` (4 MiB);
- `err-model`: returns the `result` error, as a well-behaved runner would;
- the message `trap-build` makes `build_user_message` raise.
"""

from typing import List

import wit_world
from componentize_py_types import Err
from wit_world.imports import types


def usage() -> types.Usage:
    return types.Usage(0, 0, 0)


def call(call_id: str) -> types.DeferredToolCall:
    policy = types.ToolPolicy(types.ToolEffect.READ, False)
    return types.DeferredToolCall(call_id, "anything", "{}", policy)


def requested(state: str, calls: List[types.DeferredToolCall]) -> types.TurnOutcome:
    return types.TurnOutcome_ToolCallsRequested(types.ToolCallsRequested(state, calls, usage()))


class WitWorld(wit_world.WitWorld):
    def build_user_message(self, text: str) -> types.FrameworkMessage:
        if text == "trap-build":
            raise RuntimeError("py-hostile-runner build_user_message raises on purpose")
        return types.FrameworkMessage(types.MessageRole.USER, text, text)

    def run_model_step(self, turn: types.TurnContext) -> types.TurnOutcome:
        length = turn.history.length()
        newest = turn.history.read(1, length, types.HistoryOrder.NEWEST_FIRST, 16)
        users = [m for m in reversed(newest) if m.role == types.MessageRole.USER]
        attack = users[-1].framework_item if users else ""
        if attack == "spin":
            n = 0
            while True:
                n += 1
        if attack == "history-flood":
            read = 0
            while True:
                read += len(turn.history.read(0, 2**64 - 1, types.HistoryOrder.OLDEST_FIRST, 2**32 - 1))
        if attack == "memory-bomb":
            hoard = []
            while True:
                hoard.append(bytearray(1 << 20))
        if attack == "trap-model":
            raise RuntimeError("py-hostile-runner run_model_step raises on purpose")
        if attack == "err-model":
            raise Err("py-hostile-runner returns an error on purpose")
        if attack == "empty-run-state":
            return requested("", [call("c1")])
        if attack == "dup-ids":
            return requested("state", [call("c1"), call("c1")])
        if attack == "slash-ids":
            return requested("state", [call("a/b")])
        if attack == "big-run-state":
            return requested("s" * (4 << 20), [call("c1")])
        text = f"ok: {attack}"
        message = types.FrameworkMessage(types.MessageRole.ASSISTANT, text, text)
        return types.TurnOutcome_Completed(types.TurnCompleted([message], usage()))

    def execute_deferred_tool_call(self, call: types.DeferredToolExecution) -> str:
        raise Err(types.ToolError_Execution("py-hostile-runner runs no tools"))
