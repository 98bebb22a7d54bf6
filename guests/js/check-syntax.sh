#!/usr/bin/env bash
# Checks that a JS guest's source parses, with Node's own parser, and names
# the file and line when it does not: componentize-js reports a syntax error
# without its place ("failed to parse JS source, encountered [1] errors").
# The source is checked as an ES module (.mjs): Node reads a .js file as
# CommonJS, where `export` hides the real error.
#   guests/js/check-syntax.sh path/to/tool.js
set -euo pipefail

src=$1
[ -f "$src" ] || { echo "check-syntax: no file $src" >&2; exit 2; }
command -v node >/dev/null || { echo "check-syntax: node is missing (Node.js 18 or later)" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cp "$src" "$dir/check.mjs"
if ! node --check "$dir/check.mjs" 2>"$dir/err"; then
    # Name the author's file, not the copy (no sed: a path may hold its
    # delimiters).
    while IFS= read -r line; do
        case $line in "    at "*) continue ;; esac
        printf '%s\n' "${line//"$dir/check.mjs"/$src}"
    done <"$dir/err" >&2
    exit 1
fi
