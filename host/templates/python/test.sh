#!/usr/bin/env bash
# Runs the project's tests with the machine's Python (no component needed).
set -euo pipefail
cd "$(dirname "$0")"
exec python3 -m unittest discover -v -p 'test_*.py' "$@"
