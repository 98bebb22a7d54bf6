#!/usr/bin/env bash
# The one command that installs, builds and tests everything, on a fresh
# machine or a developer's. CI runs it through .ci/run.
set -euo pipefail
cd "$(dirname "$0")"

step() { printf '\n==> %s\n' "$*"; }
started=$(date +%s)

step "toolchain: $(cargo --version)"
# A one-shot build gains nothing from incremental state, which costs GBs of disk.
if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL=0; fi
df -h . | awk 'NR==2 { print "disk: " $4 " free on " $6 }'
for component in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$component" \
        || { echo "rustup component $component is missing: rustup component add $component"; exit 1; }
done

# apt_install PACKAGE...: installs the missing ones (none: does nothing).
apt_install() {
    [ $# -gt 0 ] || return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "need root to install $*: sudo apt-get install -y $*"
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

step "browser for the web viewer test (Debian's chromium, chromium-driver), curl for the README walkthrough, faketime for the scale-out test's skewed clocks, openssl for the PostgreSQL TLS test's certificates"
missing=()
for pkg in chromium chromium-driver curl faketime openssl; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
apt_install "${missing[@]}"
chromium --version

step "guests: building every Rust guest to a wasm32-wasip2 component"
guests/build.sh

step "guests in Python (componentize-py, from PyPI), JavaScript (componentize-js, from npm) and C (clang-19, wit-bindgen c)"
missing=()
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3 python3-venv)
command -v npm >/dev/null || missing+=(nodejs npm)
command -v clang-19 >/dev/null || missing+=(clang-19)
apt_install "${missing[@]}"
echo "$(python3 --version), node $(node --version), npm $(npm --version)"
guests/python/build.sh
guests/js/build.sh
guests/c/build.sh

step "API client tools (openapi-spec-validator, openapi-python-client, Schemathesis, from PyPI) for the OpenAPI checks"
scripts/api-client-tools.sh

step "PostgreSQL for the second store backend: Debian's postgresql, a throwaway cluster on 127.0.0.1 under target/"
if [ -n "${DEXA_TEST_POSTGRES:-}" ]; then
    echo "using the server at DEXA_TEST_POSTGRES"
else
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || apt_install postgresql
    # Stopped whatever happens: on success, failure or Ctrl-C.
    trap 'scripts/test-postgres.sh stop target/postgres' EXIT
    DEXA_TEST_POSTGRES=$(scripts/test-postgres.sh start target/postgres)
    export DEXA_TEST_POSTGRES
    echo "started $DEXA_TEST_POSTGRES"
fi

step "format"
cargo fmt --all -- --check
cargo fmt --manifest-path guests/Cargo.toml --all -- --check

step "lint"
cargo clippy --workspace --all-targets -- -D warnings

step "tests (benches run once each as smoke tests)"
cargo test --workspace --all-targets

step "done in $(( $(date +%s) - started )) s"
