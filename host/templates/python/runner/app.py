"""`__NAME__`: a runner component for dexa, in Python (componentize-py): the
plain agent loop.

Each `run_model_step` sends the conversation and the session's tools to the
host's model (`model.complete`). Tool calls in the answer become deferred
tool calls, each its own durable Step on the host; the next `run_model_step`
sends their outcomes back. An answer without tool calls ends the turn. Try
it on the scripted model with the project's `dexa.toml`:

    dexa demo -c dexa.toml --agent __NAME__ --message "Hello"

Config keys: `system_prompt`, `history_window` (default 50, the newest
messages the model sees).

Every call runs in a fresh instance that is dropped afterwards: what a turn
needs between its model calls travels in `framework_run_state`.
componentize-py bundles only the modules imported when it builds, so import
at the top of a file, never inside a function.
"""

import json

import wit_world
from componentize_py_types import Err
from wit_world.imports import config, model, policy, types

from conversation import item, run_state, stored, window

ROLE_NAMES = {
    types.MessageRole.SYSTEM: "system",
    types.MessageRole.USER: "user",
    types.MessageRole.ASSISTANT: "assistant",
    types.MessageRole.TOOL: "tool",
}
ROLES = {name: role for role, name in ROLE_NAMES.items()}


def to_model(it: dict) -> types.ModelMessage:
    calls = [
        types.ModelToolCall(c["id"], c["name"], c["arguments"]) for c in it.get("tool_calls") or []
    ]
    return types.ModelMessage(
        ROLES.get(it["role"], types.MessageRole.USER), it.get("content"), calls, it.get("tool_call_id")
    )


def framework_message(it: dict) -> types.FrameworkMessage:
    return types.FrameworkMessage(
        ROLES.get(it["role"], types.MessageRole.USER), json.dumps(it), it.get("content")
    )


def history(turn: types.TurnContext) -> list:
    """The newest `history_window` stored messages, oldest first: one page
    read from the host, so a session of 10,000 messages costs what one of 50
    does."""
    try:
        size = min(max(int(config.get("history_window") or 50), 1), 500)
    except ValueError:
        size = 50
    since = turn.compaction.through_sequence if turn.compaction is not None else 0
    page = turn.history.read(
        since + 1, turn.history.length(), types.HistoryOrder.NEWEST_FIRST, size
    )
    return [stored(m.framework_item, ROLE_NAMES[m.role], m.text) for m in reversed(page)]


class WitWorld(wit_world.WitWorld):
    def build_user_message(self, text: str) -> types.FrameworkMessage:
        return framework_message(item("user", text))

    def run_model_step(self, turn: types.TurnContext) -> types.TurnOutcome:
        # `raise Err("...")` fails this attempt; the host retries RunModel.
        try:
            state = run_state(turn.framework_run_state)
        except ValueError as err:
            raise Err(f"the run state is not __NAME__'s: {err}")
        records = {r.tool_call_id: r for r in turn.tool_calls}
        for call_id in state["pending"]:
            record = records.get(call_id)
            if record is None:
                raise Err(f"no record for tool call {call_id!r}")
            outcome = policy.describe_tool_call_outcome(record)
            state["items"].append(item("tool", outcome, tool_call_id=call_id))
        state["pending"] = []

        messages = []
        prompt = config.get("system_prompt")
        if prompt and prompt.strip():
            messages.append(to_model(item("system", prompt)))
        if turn.compaction is not None:
            messages.append(to_model(item("system", turn.compaction.summary.text)))
        messages.extend(to_model(it) for it in window(history(turn)))
        messages.extend(to_model(it) for it in state["items"])
        request = types.ModelRequest(messages, turn.tools, None, None)
        try:
            response = model.complete(request)
        except Err as err:
            raise Err(f"the model call failed: {err.value!r}")

        calls = [
            {"id": c.id, "name": c.name, "arguments": c.arguments}
            for c in response.message.tool_calls
        ]
        state["items"].append(item("assistant", response.message.content, tool_calls=calls))
        if not calls:
            return types.TurnOutcome_Completed(
                types.TurnCompleted(
                    [framework_message(it) for it in state["items"]], response.usage
                )
            )
        effects = {t.name: t.effect for t in turn.tools}
        deferred = [
            types.DeferredToolCall(
                c["id"],
                c["name"],
                c["arguments"],
                # The tool's declared effect is the framework's; the
                # operator's policy in dexa.toml still wins.
                policy.resolve_tool_policy(c["name"], effects.get(c["name"])),
            )
            for c in calls
        ]
        state["pending"] = [c["id"] for c in calls]
        return types.TurnOutcome_ToolCallsRequested(
            types.ToolCallsRequested(json.dumps(state), deferred, response.usage)
        )

    def execute_deferred_tool_call(self, call: types.DeferredToolExecution) -> str:
        # Tools served by tool components never come here; a runner that
        # runs tools of its framework in-process would.
        raise Err(
            types.ToolError_Execution(
                f"__NAME__ runs no tools itself ({call.tool_call.tool_name!r})"
            )
        )
