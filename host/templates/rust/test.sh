#!/usr/bin/env bash
# Runs the project's tests natively (the bindings compile for the host too).
set -euo pipefail
cd "$(dirname "$0")"
exec cargo test "$@"
