"""`__NAME__`: a tool component for dexa, in Python (componentize-py).

It serves one tool, `__IDENT__`, which counts the words, characters and
lines of `{"text": "..."}`. Change `stats.py` and `TOOLS` below, then
`./build.sh` (or `dexa build`) and try it:

    dexa component call build/__NAME__.wasm __IDENT__ --args '{"text": "a b"}'

Every call runs in a fresh instance that is dropped afterwards: keep no
state between calls. componentize-py bundles only the modules imported when
it builds, so import at the top of a file, never inside a function.
"""

import json
import traceback

import wit_world
from componentize_py_types import Err
from wit_world.imports import config, step, types

from stats import stats

SCHEMA = '{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}'


class ExecutionError(Exception):
    """A mistake the model should see (`tool-error.execution`)."""


def count(call: types.DeferredToolExecution) -> str:
    # The model wrote the arguments: a mistake in them is an execution
    # error, which the model sees and may correct.
    try:
        text = json.loads(call.tool_call.arguments)["text"]
    except (ValueError, KeyError, TypeError) as err:
        raise ExecutionError(f'expected {{"text": "..."}}: {err!r}')
    if not isinstance(text, str):
        raise ExecutionError('"text" must be a string')
    # A long call tells the host it is alive.
    step.heartbeat()
    answer = stats(text)
    # Config comes from dexa.toml or `dexa component call --config KEY=VALUE`.
    note = config.get("note")
    if note is not None:
        answer["note"] = note
    return json.dumps(answer)


# name -> (description, parameters schema, declared effect, handler)
TOOLS = {
    "__IDENT__": (
        "Counts the words, characters and lines of a text.",
        SCHEMA,
        types.ToolEffect.READ,
        count,
    ),
}


class WitWorld(wit_world.WitWorld):
    def list_tools(self):
        return [
            types.ToolSpec(name, description, schema, effect)
            for name, (description, schema, effect, _) in TOOLS.items()
        ]

    def call(self, call: types.DeferredToolExecution) -> str:
        entry = TOOLS.get(call.tool_call.tool_name)
        if entry is None:
            raise Err(
                types.ToolError_Execution(f"__NAME__ serves no tool {call.tool_call.tool_name!r}")
            )
        try:
            return entry[3](call)
        except ExecutionError as err:
            # The error is the variant case, never a plain string: `raise
            # Err("text")` traps with KeyError(<class 'str'>).
            raise Err(types.ToolError_Execution(str(err)))
        except Exception:
            # An exception that escapes `call` traps the instance. Report it
            # as an internal error (retried as the effect allows) instead.
            raise Err(types.ToolError_Internal(traceback.format_exc(limit=4)))
