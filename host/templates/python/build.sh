#!/usr/bin/env bash
# Builds this project into build/__NAME__.wasm with componentize-py.
#
# componentize-py (pinned in requirements.txt) is installed from PyPI into
# .toolchain/ on first use; set DEXA_PY_TOOLCHAIN to a virtualenv that has
# it to share one between projects (it is used as it is). When the build
# fails, each source file is compiled by Python, so that a syntax error is
# named by its file and line.
set -euo pipefail
# A relative DEXA_PY_TOOLCHAIN is where the build was started from.
if [ -n "${DEXA_PY_TOOLCHAIN:-}" ]; then DEXA_PY_TOOLCHAIN=$(realpath -m -- "$DEXA_PY_TOOLCHAIN"); fi
cd "$(dirname "$0")"
log() { printf '[__NAME__] %s\n' "$*" >&2; }

command -v python3 >/dev/null || { log "python3 is missing (3.10 or later, with the venv module)"; exit 1; }
if [ -n "${DEXA_PY_TOOLCHAIN:-}" ]; then
    # A shared toolchain is used as it is, never installed into.
    venv=$DEXA_PY_TOOLCHAIN
    [ -x "$venv/bin/componentize-py" ] \
        || { log "DEXA_PY_TOOLCHAIN=$venv has no bin/componentize-py; install $(grep -v '^#' requirements.txt | xargs) there, or unset it"; exit 1; }
else
    venv=.toolchain
    # Installed again only when requirements.txt says something else.
    if [ ! -x "$venv/bin/componentize-py" ] || ! cmp -s requirements.txt "$venv/.installed"; then
        log "installing $(grep -v '^#' requirements.txt | xargs) into $venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet --disable-pip-version-check -r requirements.txt
        cp requirements.txt "$venv/.installed"
    fi
fi
mkdir -p build
rm -f build/__NAME__.wasm.tmp
if ! VIRTUAL_ENV="$venv" "$venv/bin/componentize-py" -d wit -w __WORLD__ componentize app -p . -o build/__NAME__.wasm.tmp >/dev/null; then
    # componentize-py's own Python (3.14) decides what parses; the
    # machine's Python, asked afterwards, names a syntax error's file and
    # line without the traceback around it, when it sees one too.
    check='
import sys, traceback
src = sys.argv[1]
try:
    compile(open(src, encoding="utf-8").read(), src, "exec")
except (SyntaxError, ValueError) as err:
    sys.stderr.write("".join(traceback.format_exception_only(err)))
    sys.exit(1)
'
    find . -name '*.py' -not -path './.toolchain/*' -not -path './build/*' | sort | while read -r src; do
        python3 -c "$check" "${src#./}" || log "${src#./} does not compile (above)"
    done
    log "componentize-py failed (above)"
    exit 1
fi
mv build/__NAME__.wasm.tmp build/__NAME__.wasm
log "built build/__NAME__.wasm ($(stat -c %s build/__NAME__.wasm) bytes)"
