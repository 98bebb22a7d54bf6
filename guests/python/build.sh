#!/usr/bin/env bash
# Builds the Python guests with componentize-py into target/guests/:
#   guests/python/tool           -> py-tool.wasm            (world `tool`)
#   guests/python/runner         -> py-runner.wasm          (world `runner`)
#   guests/python/hostile-tool   -> py-hostile-tool.wasm    (attacks, for tests)
#   guests/python/hostile-runner -> py-hostile-runner.wasm
#
# componentize-py (pinned in requirements.txt) is installed from PyPI into a
# virtualenv under target/guest-toolchains/python on first use. Unchanged
# components are kept (guests/lib.sh); `--force` rebuilds them.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
log_prefix="python guests"
. "$here/../lib.sh" "$@"
venv="$root/target/guest-toolchains/python"

command -v python3 >/dev/null || { log "python3 is missing (3.10 or later, with the venv module)"; exit 1; }
if [ ! -x "$venv/bin/componentize-py" ] || [ "$here/requirements.txt" -nt "$venv/.installed" ]; then
    log "installing $(grep -v '^#' "$here/requirements.txt" | xargs) into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    touch "$venv/.installed"
fi
version=$("$venv/bin/componentize-py" --version) \
    || { log "componentize-py does not start; reinstall it: rm -rf $venv"; exit 1; }
log "$version"
mkdir -p "$out"

# The app's directory and the toolchain's own virtualenv make the Python path,
# never the machine's site-packages: what the app imports comes from there.
build() { # <source dir> <world> <output name>
    local src="$here/$1" world=$2 wasm="$out/$3.wasm"
    if up_to_date "$wasm" "$src" "$root/wit" "$venv/.installed"; then
        log "$3: up to date"
        return
    fi
    local started=$SECONDS
    (cd "$src" && VIRTUAL_ENV="$venv" "$venv/bin/componentize-py" -d "$root/wit" -w "$world" \
        componentize app -p "$src" -o "$wasm.tmp" >/dev/null)
    mv "$wasm.tmp" "$wasm"
    log "$3: built in $((SECONDS - started)) s, $(stat -c %s "$wasm") bytes"
}

build tool tool py-tool
build runner runner py-runner
build hostile-tool tool py-hostile-tool
build hostile-runner runner py-hostile-runner
