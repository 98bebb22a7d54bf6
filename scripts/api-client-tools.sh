#!/usr/bin/env bash
# Installs the tools tests/tests/api_client.rs runs on /openapi.json, from
# PyPI at the versions tests/api-client/requirements.txt pins (and every
# dependency at the version constraints.txt pins), into a
# virtualenv under target/api-client-tools (once; again when the pins
# change). Prints the virtualenv's path.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/target/api-client-tools"
requirements="$root/tests/api-client/requirements.txt"
constraints="$root/tests/api-client/constraints.txt"

command -v python3 >/dev/null || { echo "python3 is missing (3.10 or later, with the venv module)" >&2; exit 1; }
# Again when a pin changed, or when the interpreter the virtualenv links to
# is gone (a Python upgrade).
if [ ! -x "$venv/bin/openapi-python-client" ] || [ "$requirements" -nt "$venv/.installed" ] \
    || [ "$constraints" -nt "$venv/.installed" ] || ! "$venv/bin/python" -c '' 2>/dev/null; then
    echo "installing $(grep -v '^#' "$requirements" | xargs) into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$requirements" -c "$constraints"
    touch "$venv/.installed"
fi
echo "$venv"
