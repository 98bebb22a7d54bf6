#!/usr/bin/env bash
# Builds this project into build/__NAME__.wasm, a wasm32-wasip2 component.
#
# - With rustup's wasm32-wasip2 target installed, it uses it.
# - Otherwise it builds Rust's std for wasm with Debian's Rust and
#   -Zbuild-std (the packages below; root installs them), which takes a few
#   minutes the first time. Set CARGO_TARGET_DIR to share a target
#   directory, and that work, between projects.
#
# Usage: ./build.sh [--debug]
set -euo pipefail
# A relative CARGO_TARGET_DIR is where the build was started from.
if [ -n "${CARGO_TARGET_DIR:-}" ]; then
    CARGO_TARGET_DIR=$(realpath -m -- "$CARGO_TARGET_DIR")
    export CARGO_TARGET_DIR
fi
cd "$(dirname "$0")"

profile=release
[ "${1:-}" = "--debug" ] && profile=debug
profile_flag=()
[ "$profile" = release ] && profile_flag=(--release)
log() { printf '[__NAME__] %s\n' "$*" >&2; }

if rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
    cargo build "${profile_flag[@]}" --target wasm32-wasip2
else
    packages=(rust-web-src rustc-web cargo-web lld-22 wasi-libc)
    missing=()
    for pkg in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        if ! command -v apt-get >/dev/null; then
            log "no wasm32-wasip2 target: install it with rustup target add wasm32-wasip2"
            exit 1
        fi
        if [ "$(id -u)" -ne 0 ]; then
            log "no wasm32-wasip2 target: install it (rustup target add wasm32-wasip2), or the Debian packages: sudo apt-get install -y ${missing[*]}"
            exit 1
        fi
        log "installing Debian packages for the wasm std build: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    sysroot=$(rustup run stable rustc --print sysroot 2>/dev/null || rustc --print sysroot)
    host=$(rustc -vV | sed -n 's/^host: //p')
    component_ld="$sysroot/lib/rustlib/$host/bin/wasm-component-ld"
    [ -x "$component_ld" ] || { log "wasm-component-ld not found at $component_ld"; exit 1; }
    export RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1
    export CARGO_TARGET_WASM32_WASIP2_LINKER="$component_ld"
    export CARGO_TARGET_WASM32_WASIP2_RUSTFLAGS="-Clink-self-contained=no -Lnative=/usr/lib/wasm32-wasi -Clink-arg=--wasm-ld-path=/usr/lib/llvm-22/bin/wasm-ld"
    # rustup's cargo shadows Debian's on PATH; -Zbuild-std needs Debian's.
    /usr/bin/cargo build "${profile_flag[@]}" -Zbuild-std=std,panic_abort --target wasm32-wasip2
fi

# Where cargo put it: CARGO_TARGET_DIR, a cargo config's target-dir, or target/.
target_dir=$(cargo metadata --no-deps --format-version 1 --offline 2>/dev/null \
    | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4 || true)
target_dir=${target_dir:-${CARGO_TARGET_DIR:-target}}
mkdir -p build
cp "$target_dir/wasm32-wasip2/$profile/__IDENT__.wasm" build/__NAME__.wasm
log "built build/__NAME__.wasm ($(stat -c %s build/__NAME__.wasm) bytes)"
