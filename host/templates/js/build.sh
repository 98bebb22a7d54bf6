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
# Every source is parsed by Node first (check-syntax.sh), which names an
# error's file and line.
find src -name '*.js' | sort | while read -r src; do
    ./check-syntax.sh "$src" || { log "$src does not parse (above)"; exit 1; }
done || exit 1
mkdir -p build
rm -f build/__NAME__.wasm.tmp
# The source comes first: -d takes every word up to the next option.
node "$cli" src/component.js --wit wit --world-name __WORLD__ -d http fetch-event -o build/__NAME__.wasm.tmp
[ -s build/__NAME__.wasm.tmp ] || { log "componentize-js wrote no component"; exit 1; }
mv build/__NAME__.wasm.tmp build/__NAME__.wasm
log "built build/__NAME__.wasm ($(stat -c %s build/__NAME__.wasm) bytes)"
