#!/usr/bin/env bash
# Builds every Rust guest in this workspace to a wasm32-wasip2 component and
# copies them to target/guests/<name>.wasm at the repository root.
#
# - Where rustup has the wasm32-wasip2 target installed, it uses it.
# - Otherwise it builds std for wasm itself with Debian's Rust (the recipe in
#   DESIGN.md), installing the Debian packages it needs when they are missing.
#
# Usage: guests/build.sh [--debug]
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
profile=release
[ "${1:-}" = "--debug" ] && profile=debug
out="$root/target/guests"
export CARGO_TARGET_DIR="$root/target/wasm"
mkdir -p "$out"

log() { printf '[guests] %s\n' "$*" >&2; }

profile_flag=()
[ "$profile" = release ] && profile_flag=(--release)

if rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip2; then
    log "building with rustup's wasm32-wasip2 target"
    (cd "$here" && cargo build "${profile_flag[@]}" --target wasm32-wasip2 --workspace --exclude tiny-tool \
        && cargo build "${profile_flag[@]}" --target wasm32-wasip2 -p tiny-tool)
else
    debian_packages=(rust-web-src rustc-web cargo-web lld-22 wasi-libc)
    missing=()
    for pkg in "${debian_packages[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing Debian packages for the offline wasm std build: ${missing[*]}"
        if [ "$(id -u)" -ne 0 ]; then
            log "need root to apt-get install ${missing[*]}; run: sudo apt-get install -y ${missing[*]}"
            exit 1
        fi
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    sysroot=$(rustup run stable rustc --print sysroot 2>/dev/null || rustc --print sysroot)
    component_ld="$sysroot/lib/rustlib/x86_64-unknown-linux-gnu/bin/wasm-component-ld"
    [ -x "$component_ld" ] || { log "wasm-component-ld not found at $component_ld"; exit 1; }
    std_marker="$CARGO_TARGET_DIR/wasm32-wasip2/$profile/.dexa-std-built"
    [ -f "$std_marker" ] || log "first build: compiling Rust std for wasm32-wasip2 (about 4 to 7 minutes, once)"
    log "building with Debian's Rust $(/usr/bin/rustc --version | cut -d' ' -f2) and -Zbuild-std"
    (
        cd "$here"
        export RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1
        export CARGO_TARGET_WASM32_WASIP2_LINKER="$component_ld"
        export CARGO_TARGET_WASM32_WASIP2_RUSTFLAGS="-Clink-self-contained=no -Lnative=/usr/lib/wasm32-wasi -Clink-arg=--wasm-ld-path=/usr/lib/llvm-22/bin/wasm-ld"
        # rustup's cargo shadows Debian's on PATH; -Zbuild-std needs Debian's.
        build() { /usr/bin/cargo build "${profile_flag[@]}" -Zbuild-std=std,panic_abort --target wasm32-wasip2 "$@"; }
        build --workspace --exclude tiny-tool
        build -p tiny-tool
    )
    touch "$std_marker"
fi

# Only this workspace's members: a project built elsewhere with this target
# directory as its CARGO_TARGET_DIR (to share the std for wasm, as the
# `dexa new` test does) leaves its component here too.
count=0
for manifest in "$here"/*/Cargo.toml "$here"/hostile/*/Cargo.toml; do
    name=$(sed -n 's/^name = "\(.*\)"/\1/p' "$manifest" | head -1)
    wasm="$CARGO_TARGET_DIR/wasm32-wasip2/$profile/${name//-/_}.wasm"
    [ -f "$wasm" ] || continue
    cp "$wasm" "$out/$name.wasm"
    count=$((count + 1))
done
log "$count components in $out"
