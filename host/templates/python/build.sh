#!/usr/bin/env bash
# Builds this project into build/__NAME__.wasm with componentize-py.
#
# componentize-py (pinned in requirements.txt) is installed from PyPI into
# .toolchain/ on first use; set DEXA_PY_TOOLCHAIN to a virtualenv that has
# it to share one between projects. Each source file is compiled by Python
# first, so a syntax error names its file and line.
set -euo pipefail
cd "$(dirname "$0")"
log() { printf '[__NAME__] %s\n' "$*" >&2; }

command -v python3 >/dev/null || { log "python3 is missing (3.10 or later, with the venv module)"; exit 1; }
venv=${DEXA_PY_TOOLCHAIN:-.toolchain}
if [ ! -x "$venv/bin/componentize-py" ] || [ requirements.txt -nt "$venv/.installed" ]; then
    log "installing $(grep -v '^#' requirements.txt | xargs) into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r requirements.txt
    touch "$venv/.installed"
fi
check='
import sys, traceback
src = sys.argv[1]
try:
    compile(open(src, encoding="utf-8").read(), src, "exec")
except (SyntaxError, ValueError) as err:
    sys.stderr.write("".join(traceback.format_exception_only(err)))
    sys.exit(1)
'
for src in *.py; do
    python3 -c "$check" "$src" || { log "$src does not compile (above)"; exit 1; }
done
mkdir -p build
VIRTUAL_ENV="$venv" "$venv/bin/componentize-py" -d wit -w __WORLD__ componentize app -p . -o build/__NAME__.wasm.tmp >/dev/null
mv build/__NAME__.wasm.tmp build/__NAME__.wasm
log "built build/__NAME__.wasm ($(stat -c %s build/__NAME__.wasm) bytes)"
