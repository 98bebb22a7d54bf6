#!/usr/bin/env bash
# Builds the JavaScript guests with componentize-js into target/guests/:
#   guests/js/tool/tool.js         -> js-tool.wasm          (world `tool`)
#   guests/js/hostile-tool/tool.js -> js-hostile-tool.wasm  (attacks, for tests)
#
# componentize-js is pinned in package-lock.json and installed with `npm ci`
# on first use. `-d http fetch-event` leaves wasi:http out of the component,
# since a tool reaches the network only through a grant anyway. Unchanged
# components are kept (guests/lib.sh); `--force` rebuilds them.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
log_prefix="js guests"
. "$here/../lib.sh" "$@"

command -v npm >/dev/null || { log "node and npm are missing (Node.js 18 or later)"; exit 1; }
cli="$here/node_modules/@bytecodealliance/componentize-js/src/cli.js"
if [ ! -f "$cli" ] || [ "$here/package-lock.json" -nt "$here/node_modules/.package-lock.json" ]; then
    log "installing componentize-js from package-lock.json (npm ci)"
    (cd "$here" && npm ci --no-audit --no-fund --loglevel=error)
fi
version=$(node "$cli" --version) \
    || { log "componentize-js does not start; reinstall it: rm -rf $here/node_modules"; exit 1; }
log "componentize-js $version"
mkdir -p "$out"

build() { # <source file> <world> <output name>
    local src="$here/$1" world=$2 wasm="$out/$3.wasm"
    if up_to_date "$wasm" "$src" "$root/wit" "$here/package-lock.json"; then
        log "$3: up to date"
        return
    fi
    local started=$SECONDS
    # componentize-js reports a syntax error without its place.
    "$here/check-syntax.sh" "$src" || { log "$3: $1 does not parse (above)"; exit 1; }
    rm -f "$wasm.tmp"
    # The source comes first: -d takes every word up to the next option.
    node "$cli" "$src" --wit "$root/wit" --world-name "$world" -d http fetch-event -o "$wasm.tmp"
    # componentize-js prints nothing on success; check that it wrote the file.
    [ -s "$wasm.tmp" ] || { log "$3: componentize-js wrote no component"; exit 1; }
    mv "$wasm.tmp" "$wasm"
    log "$3: built in $((SECONDS - started)) s, $(stat -c %s "$wasm") bytes"
}

build tool/tool.js tool js-tool
build hostile-tool/tool.js tool js-hostile-tool
