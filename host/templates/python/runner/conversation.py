"""The runner's own message format, apart from the component's bindings, so
that `python3 -m unittest` runs it without building the component.

An item is a model message as JSON: the `framework_item` this runner stores,
so a later turn replays the conversation exactly, tool calls included."""

import json
from typing import List, Optional


def item(role: str, content: Optional[str], tool_calls=None, tool_call_id=None) -> dict:
    out = {"role": role, "content": content}
    if tool_calls:
        out["tool_calls"] = tool_calls
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out


ROLES = ("system", "user", "assistant", "tool")


def is_item(parsed) -> bool:
    """Whether parsed JSON has this runner's item shape."""
    if not isinstance(parsed, dict) or parsed.get("role") not in ROLES:
        return False
    if not isinstance(parsed.get("content"), (str, type(None))):
        return False
    if not isinstance(parsed.get("tool_call_id"), (str, type(None))):
        return False
    calls = parsed.get("tool_calls") or []
    return isinstance(calls, list) and all(
        isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("id", "name", "arguments"))
        for c in calls
    )


def stored(framework_item: str, role: str, text: Optional[str]) -> dict:
    """A stored message back as an item. A message this runner did not write
    (the host's turn-failure note, an imported history) is taken by its role
    and text."""
    try:
        parsed = json.loads(framework_item)
    except ValueError:
        parsed = None
    return parsed if is_item(parsed) else item(role, text)


def run_state(text: Optional[str]) -> dict:
    """The run state this runner wrote, or a fresh one; ValueError for one
    it did not write."""
    if text is None:
        return {"items": [], "pending": []}
    state = json.loads(text)
    if (
        not isinstance(state, dict)
        or not isinstance(state.get("items"), list)
        or not all(is_item(it) for it in state["items"])
        or not isinstance(state.get("pending"), list)
        or not all(isinstance(p, str) for p in state["pending"])
    ):
        raise ValueError("not this runner's run state")
    return state


def window(items: List[dict]) -> List[dict]:
    """The messages a model may be sent: a tool result whose call is not
    among them (cut off by the window) is dropped, since a model API refuses
    one."""
    announced = set()
    kept = []
    for it in items:
        if it["role"] == "tool" and it.get("tool_call_id") not in announced:
            continue
        announced.update(c["id"] for c in it.get("tool_calls") or [])
        kept.append(it)
    return kept
