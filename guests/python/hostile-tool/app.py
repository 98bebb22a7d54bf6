"""`py-hostile-tool`: a Python tool that attacks its sandbox, for
`tests/tests/hostile_languages.rs`. Each tool is one attack; nothing is
caught, so an exception traps the instance as it would in careless code.

- `py_spin`: an endless loop in the interpreter;
- `py_memory_bomb`: allocates 1 MiB blocks until something gives;
- `py_recurse`: lifts Python's recursion limit and recurses;
- `py_read_file`: `open(path).read()` (try `/data/../secret.txt`);
- `py_read_env`: `os.environ[name]`;
- `py_tcp_connect`: a TCP `connect` to `ip:port`;
- `py_big_output`: returns `megabytes` MiB of text;
- `py_event_flood`: writes 13 MB of events, far over its budget;
- `py_trap`: raises an exception that nothing catches.
"""

import json
import os
import socket
import sys
from typing import List

import wit_world
from wit_world.imports import events, types

TOOLS = [
    "py_spin",
    "py_memory_bomb",
    "py_recurse",
    "py_read_file",
    "py_read_env",
    "py_tcp_connect",
    "py_big_output",
    "py_event_flood",
    "py_trap",
]


def recurse(depth: int) -> int:
    return recurse(depth + 1) + 1


class WitWorld(wit_world.WitWorld):
    def list_tools(self) -> List[types.ToolSpec]:
        return [
            types.ToolSpec(name, "A hostile attack.", '{"type":"object"}', types.ToolEffect.READ)
            for name in TOOLS
        ]

    def call(self, call: types.DeferredToolExecution) -> str:
        name = call.tool_call.tool_name
        args = json.loads(call.tool_call.arguments or "{}")
        if name == "py_spin":
            n = 0
            while True:
                n += 1
        if name == "py_memory_bomb":
            hoard = []
            while True:
                hoard.append(bytearray(1 << 20))
        if name == "py_recurse":
            sys.setrecursionlimit(10_000_000)
            return str(recurse(0))
        if name == "py_read_file":
            with open(args["path"]) as f:
                return f.read()
        if name == "py_read_env":
            return os.environ[args["name"]]
        if name == "py_tcp_connect":
            host, port = args["addr"].rsplit(":", 1)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.settimeout(2)
                sock.connect((host, int(port)))
                return "connected"
        if name == "py_big_output":
            return "x" * (int(args["megabytes"]) << 20)
        if name == "py_event_flood":
            payload = json.dumps({"pad": "y" * 65536})
            for _ in range(200):
                events.write_event("flood", payload)
            return "flooded"
        if name == "py_trap":
            raise RuntimeError("py-hostile-tool raises on purpose")
        raise KeyError(name)
