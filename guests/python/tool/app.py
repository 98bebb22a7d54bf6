"""`py-tool`: a tool component written in Python (componentize-py).

It serves the same scenarios as the Rust `echo-tool`, so the tests can run
every language through one set of sessions:

- `py_echo` (read): returns its arguments;
- `py_describe_call` (read): the call as the tool saw it, idempotency key
  included;
- `py_word_count` (read): counts the words of `{"text": ...}`, writes an
  event, and reads the optional `greeting` config key;
- `py_fail`: a `tool-error.execution`, which the host records as `failed`
  without a retry;
- `py_raise`: raises an unexpected exception. `call` turns it into
  `tool-error.internal`, which the host retries as the effect allows.

Every call runs in a fresh instance: nothing here survives between calls.
"""

import json
import traceback
from typing import Callable, Dict, List

import wit_world
from componentize_py_types import Err
from wit_world.imports import config, events, step, types

LANGUAGE = "python"
OBJECT_SCHEMA = '{"type":"object"}'
TEXT_SCHEMA = (
    '{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}'
)


class ExecutionError(Exception):
    """A failure the model should see (`tool-error.execution`)."""


def echo(call: types.DeferredToolExecution) -> str:
    return call.tool_call.arguments


def describe_call(call: types.DeferredToolExecution) -> str:
    return json.dumps(
        {
            "language": LANGUAGE,
            "flow_id": call.flow_id,
            "turn_id": call.turn_id,
            "tool_call_id": call.tool_call.tool_call_id,
            "idempotency_key": call.idempotency_key,
            "attempt": call.attempt,
            "arguments": call.tool_call.arguments,
        }
    )


def word_count(call: types.DeferredToolExecution) -> str:
    try:
        text = json.loads(call.tool_call.arguments)["text"]
    except (ValueError, KeyError, TypeError) as err:
        raise ExecutionError(f'expected {{"text": "..."}}: {err!r}')
    if not isinstance(text, str):
        raise ExecutionError('"text" must be a string')
    step.heartbeat()
    words = len(text.split())
    events.write_event("py_word_count.counted", json.dumps({"words": words}))
    result = {"words": words}
    greeting = config.get("greeting")
    if greeting is not None:
        result["greeting"] = greeting
    return json.dumps(result)


def fail(call: types.DeferredToolExecution) -> str:
    raise ExecutionError(f"{LANGUAGE}-tool refused: {call.tool_call.arguments}")


def raise_unexpected(call: types.DeferredToolExecution) -> str:
    raise ValueError(f"{LANGUAGE}-tool raised on purpose")


# name -> (description, parameters schema, declared effect, handler)
TOOLS: Dict[str, tuple] = {
    "py_echo": ("Returns its arguments.", OBJECT_SCHEMA, types.ToolEffect.READ, echo),
    "py_describe_call": (
        "Returns the call as the tool saw it.",
        OBJECT_SCHEMA,
        types.ToolEffect.READ,
        describe_call,
    ),
    "py_word_count": (
        "Counts the words of a text.",
        TEXT_SCHEMA,
        types.ToolEffect.READ,
        word_count,
    ),
    "py_fail": (
        "Fails with an error the model sees.",
        OBJECT_SCHEMA,
        types.ToolEffect.READ,
        fail,
    ),
    "py_raise": (
        "Raises an unexpected exception.",
        OBJECT_SCHEMA,
        types.ToolEffect.READ,
        raise_unexpected,
    ),
}


class WitWorld(wit_world.WitWorld):
    def list_tools(self) -> List[types.ToolSpec]:
        return [
            types.ToolSpec(name, description, schema, effect)
            for name, (description, schema, effect, _) in TOOLS.items()
        ]

    def call(self, call: types.DeferredToolExecution) -> str:
        name = call.tool_call.tool_name
        entry = TOOLS.get(name)
        if entry is None:
            raise Err(types.ToolError_Execution(f"{LANGUAGE}-tool serves no tool {name!r}"))
        handler: Callable[[types.DeferredToolExecution], str] = entry[3]
        try:
            return handler(call)
        except ExecutionError as err:
            raise Err(types.ToolError_Execution(str(err)))
        except Exception:
            # An exception that escapes `call` traps the instance. Report it
            # as an internal error instead, with its traceback, so the host
            # retries as the effect allows and records a readable error.
            raise Err(types.ToolError_Internal(traceback.format_exc(limit=4)))
