# What the build scripts of the Python, JavaScript and C guests share.
# Sourced, not run: `. "$here/../lib.sh" "$@"` with `here` (the script's
# directory) and `log_prefix` set. It sets `root`, `out` (target/guests) and
# `force` (the script's `--force`), and defines `log` and `up_to_date`.

root=$(cd "$here/../.." && pwd)
out="$root/target/guests"
force=0
[ "${1:-}" = "--force" ] && force=1

log() { printf '[%s] %s\n' "$log_prefix" "$*" >&2; }

# up_to_date WASM INPUT...: WASM exists and no input file is newer. Builds
# are not byte-identical, and a new .wasm makes the host compile it again,
# so an unchanged component is kept. `--force` rebuilds anyway.
up_to_date() {
    local wasm=$1
    shift
    [ "$force" -eq 0 ] && [ -f "$wasm" ] \
        && [ -z "$(find "$@" -newer "$wasm" -type f -not -path '*/__pycache__/*' | head -1)" ]
}
