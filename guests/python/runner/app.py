"""`py-runner`: the plain agent loop as a runner component, in Python
(componentize-py). It behaves like the Rust `chat-runner`:

- each `run_model_step` sends the conversation and the session's tools to the
  host's model (`model.complete`);
- tool calls in the answer become deferred tool calls, each its own durable
  Step on the host; the next step sends their outcomes back to the model;
- an answer without tool calls ends the turn.

Config keys: `system_prompt`, `temperature`, `max_output_tokens`,
`compact_after` (default 100; `0` turns compaction off), `compact_keep`
(default 20), `compact_chunk` (default 400) and `history_window` (default 200).

The prompt is the newest compaction's summary, if any, and the messages after
it (at most the newest `history_window`), read from the host's history a page
at a time. When a turn begins with more than `compact_after` messages after
the summary, its first model call summarizes the old summary and the messages
after it but the newest `compact_keep` (at most `compact_chunk`, each cut to
2,000 characters) instead, and the host calls the runner again with that
compaction, as `chat-runner` does.

Each stored message's `framework_item` is the model message as JSON, so later
turns replay the conversation exactly, tool calls included. What the runner
needs between the model calls of one turn travels in the run state; nothing
is kept in the instance, which the host drops after every call.
"""

import json
from typing import List, Optional

import wit_world
from componentize_py_types import Err
from wit_world.imports import config, model, policy, types

ROLE_NAMES = {
    types.MessageRole.SYSTEM: "system",
    types.MessageRole.USER: "user",
    types.MessageRole.ASSISTANT: "assistant",
    types.MessageRole.TOOL: "tool",
}
ROLES = {name: role for role, name in ROLE_NAMES.items()}


def item(role: str, content: Optional[str], tool_calls=None, tool_call_id=None) -> dict:
    """A model message as JSON: the runner's framework item."""
    out = {"role": role, "content": content}
    if tool_calls:
        out["tool_calls"] = tool_calls
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out


def is_item(parsed) -> bool:
    """Whether a parsed framework item has this runner's shape (an imported
    message may be JSON of another shape)."""
    if not isinstance(parsed, dict) or parsed.get("role") not in ROLES:
        return False
    if not isinstance(parsed.get("content"), (str, type(None))):
        return False
    if not isinstance(parsed.get("tool_call_id"), (str, type(None))):
        return False
    calls = parsed.get("tool_calls") or []
    if not isinstance(calls, list):
        return False
    return all(
        isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("id", "name", "arguments"))
        for c in calls
    )


def stored_item(message: types.AgentMessage) -> dict:
    """A stored message back as an item. Messages the host wrote (such as the
    turn-failure note) came from `build_user_message` too; anything that does
    not parse as this runner's item is taken by its role and text."""
    try:
        parsed = json.loads(message.framework_item)
        if is_item(parsed):
            return parsed
    except ValueError:
        pass
    return item(ROLE_NAMES[message.role], message.text)


def to_model(it: dict) -> types.ModelMessage:
    calls = [
        types.ModelToolCall(c["id"], c["name"], c["arguments"])
        for c in it.get("tool_calls") or []
    ]
    return types.ModelMessage(
        ROLES.get(it["role"], types.MessageRole.USER),
        it.get("content"),
        calls,
        it.get("tool_call_id"),
    )


def framework_message(it: dict) -> types.FrameworkMessage:
    return types.FrameworkMessage(
        ROLES.get(it["role"], types.MessageRole.USER), json.dumps(it), it.get("content")
    )


def optional_number(key: str, kind):
    value = config.get(key)
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        return None


def describe_model_error(error) -> str:
    """`ModelError_Transient("...")` as `transient: ...`."""
    case = type(error).__name__.split("_", 1)[-1].lower()
    detail = getattr(error, "value", None)
    return f"{case}: {detail}" if detail else case


PAGE = 500


def read_range(history, first: int, last: int) -> List[types.AgentMessage]:
    """Messages `first..=last`, oldest first, a page at a time."""
    out: List[types.AgentMessage] = []
    following = max(first, 1)
    while following <= last:
        page = history.read(following, last, types.HistoryOrder.OLDEST_FIRST, PAGE)
        if not page:
            break
        out.extend(page)
        following = page[-1].sequence + 1
    return out


def config_number(key: str, default: int) -> int:
    value = optional_number(key, int)
    return default if value is None else value


TRANSCRIPT_MESSAGE_CHARS = 2000


def transcript(messages: List[types.AgentMessage]) -> str:
    """Plain lines the model can summarize: no tool call without its result,
    each cut to a bounded length."""
    lines = []
    for message in messages:
        it = stored_item(message)
        line = f"{it['role']}: {it.get('content') or ''}"
        for call in it.get("tool_calls") or []:
            line += f" [calls {call['name']}({call['arguments']})]"
        if len(line) > TRANSCRIPT_MESSAGE_CHARS:
            line = line[:TRANSCRIPT_MESSAGE_CHARS] + " [...]"
        lines.append(line)
    return "\n".join(lines) + "\n"


def compaction(turn: types.TurnContext) -> Optional[types.TurnOutcome]:
    """The turn's first model call summarizes the history when more than
    `compact_after` messages follow the newest summary."""
    after = config_number("compact_after", 100)
    if after <= 0 or turn.framework_run_state is not None:
        return None
    keep = max(config_number("compact_keep", 20), 1)
    length = turn.history.length()
    earlier = turn.compaction
    since = earlier.through_sequence if earlier is not None else 0
    if earlier is not None and earlier.turn_id == turn.turn_id:
        return None
    if length - since <= after or length <= since + keep:
        return None
    chunk = max(config_number("compact_chunk", 400), 1)
    through = min(length - keep, since + chunk)
    prompt = (
        "Summarize the conversation below for your own later use. Keep facts, "
        "decisions, names, numbers, open tasks and what each tool did. Reply with "
        "the summary only.\n\n"
    )
    if earlier is not None:
        prompt += f"Summary of the conversation before it:\n{earlier.summary.text or ''}\n\n"
    prompt += transcript(read_range(turn.history, since + 1, through))
    request = types.ModelRequest(
        [types.ModelMessage(types.MessageRole.USER, prompt, [], None)],
        [],
        None,
        optional_number("max_output_tokens", int),
    )
    try:
        response = model.complete(request)
    except Err as err:
        raise Err(f"the summarizing model call failed: {describe_model_error(err.value)}")
    text = (
        f"Summary of the conversation through message {through}:\n"
        f"{response.message.content or ''}"
    )
    summary = framework_message(item("system", text))
    return types.TurnOutcome_Compacted(
        types.HistoryCompacted(through, summary, response.usage)
    )


def conversation(turn: types.TurnContext) -> List[types.ModelMessage]:
    """The newest summary, then the messages after it, at most the newest
    `history_window`."""
    messages: List[types.ModelMessage] = []
    since = 0
    if turn.compaction is not None:
        summary = turn.compaction.summary
        text = summary.text if summary.text is not None else summary.framework_item
        messages.append(types.ModelMessage(types.MessageRole.SYSTEM, text, [], None))
        since = turn.compaction.through_sequence
    length = turn.history.length()
    window = max(config_number("history_window", 200), 1)
    first = max(since + 1, length + 1 - window)
    announced = set()
    for it in (stored_item(m) for m in read_range(turn.history, first, length)):
        # A tool result whose call is not in the window (summarized, or cut
        # off) is dropped: a model API refuses one.
        if it["role"] == "tool" and it.get("tool_call_id") not in announced:
            continue
        announced.update(c["id"] for c in it.get("tool_calls") or [])
        messages.append(to_model(it))
    return messages


class WitWorld(wit_world.WitWorld):
    def build_user_message(self, text: str) -> types.FrameworkMessage:
        return framework_message(item("user", text))

    def run_model_step(self, turn: types.TurnContext) -> types.TurnOutcome:
        # result<turn-outcome, string>: `raise Err("...")` fails the attempt,
        # and the host retries RunModel (3 attempts in all).
        state = {"items": [], "pending": []}
        if turn.framework_run_state is not None:
            try:
                state = json.loads(turn.framework_run_state)
            except ValueError as err:
                raise Err(f"run state is not py-runner's: {err}")
        records = {r.tool_call_id: r for r in turn.tool_calls}
        for call_id in state["pending"]:
            record = records.get(call_id)
            if record is None:
                raise Err(f"no record for tool call {call_id!r}")
            outcome = policy.describe_tool_call_outcome(record)
            state["items"].append(item("tool", outcome, tool_call_id=call_id))
        state["pending"] = []

        compacted = compaction(turn)
        if compacted is not None:
            return compacted
        messages: List[types.ModelMessage] = []
        prompt = config.get("system_prompt")
        if prompt and prompt.strip():
            messages.append(types.ModelMessage(types.MessageRole.SYSTEM, prompt, [], None))
        messages.extend(conversation(turn))
        messages.extend(to_model(it) for it in state["items"])
        request = types.ModelRequest(
            messages,
            turn.tools,
            optional_number("temperature", float),
            optional_number("max_output_tokens", int),
        )
        try:
            response = model.complete(request)
        except Err as err:
            raise Err(f"the model call failed: {describe_model_error(err.value)}")

        calls = [
            {"id": c.id, "name": c.name, "arguments": c.arguments}
            for c in response.message.tool_calls
        ]
        answer = item("assistant", response.message.content, tool_calls=calls)
        state["items"].append(answer)
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
                # The tool's declared effect is the framework's effect; the
                # operator's explicit policy still wins in the host.
                policy.resolve_tool_policy(c["name"], effects.get(c["name"])),
            )
            for c in calls
        ]
        state["pending"] = [c["id"] for c in calls]
        return types.TurnOutcome_ToolCallsRequested(
            types.ToolCallsRequested(json.dumps(state), deferred, response.usage)
        )

    def execute_deferred_tool_call(self, call: types.DeferredToolExecution) -> str:
        raise Err(
            types.ToolError_Execution(
                f"no tool component serves {call.tool_call.tool_name!r}, "
                "and py-runner runs no tools itself"
            )
        )
