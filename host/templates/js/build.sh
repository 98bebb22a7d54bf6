#!/usr/bin/env bash
# Builds this project into build/__NAME__.wasm with componentize-js.
#
# componentize-js is pinned in package-lock.json and installed with `npm ci`
# on first use. Each source file is parsed by Node first, so a syntax error
# names its file and line (componentize-js does not). `-d http fetch-event`
# leaves wasi:http out: a component reaches the network only through a
# grant anyway.
set -euo pipefail
cd "$(dirname "$0")"
log() { printf '[__NAME__] %s\n' "$*" >&2; }

command -v npm >/dev/null || { log "node and npm are missing (Node.js 18 or later)"; exit 1; }
cli=node_modules/@bytecodealliance/componentize-js/src/cli.js
if [ ! -f "$cli" ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
    log "installing componentize-js from package-lock.json (npm ci)"
    npm ci --no-audit --no-fund --loglevel=error
fi
# Node reads a .js file as CommonJS, where `export` hides the real error:
# check a copy named .mjs, and name the author's file in the message.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
find src -name '*.js' | sort | while read -r src; do
    cp "$src" "$check/check.mjs"
    if ! node --check "$check/check.mjs" 2>"$check/err"; then
        while IFS= read -r line; do
            case $line in "    at "*) continue ;; esac
            printf '%s\n' "${line//"$check/check.mjs"/$src}"
        done <"$check/err" >&2
        log "$src does not parse (above)"
        exit 1
    fi
done || exit 1
mkdir -p build
rm -f build/__NAME__.wasm.tmp
# The source comes first: -d takes every word up to the next option.
node "$cli" src/component.js --wit wit --world-name __WORLD__ -d http fetch-event -o build/__NAME__.wasm.tmp
[ -s build/__NAME__.wasm.tmp ] || { log "componentize-js wrote no component"; exit 1; }
mv build/__NAME__.wasm.tmp build/__NAME__.wasm
log "built build/__NAME__.wasm ($(stat -c %s build/__NAME__.wasm) bytes)"
