#!/usr/bin/env bash
# Runs the project's tests with Node's test runner (no component needed).
set -euo pipefail
cd "$(dirname "$0")"
exec node --test test/*.test.js "$@"
