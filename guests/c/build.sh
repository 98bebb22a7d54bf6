#!/usr/bin/env bash
# Builds the C guests into target/guests/:
#   guests/c/tool/tool.c -> c-tool.wasm  (world `tool`)
#
# The bindings come from `wit-bindgen c` (wit-bindgen-cli 0.63.0, installed
# with cargo into target/guest-toolchains/c on first use, C generator only);
# clang-19 compiles against Debian's wasi-libc, and wasm-component-ld (from
# the Rust toolchain, as in guests/build.sh) links a component with wasm-ld.
# Unchanged components are kept (guests/lib.sh); `--force` rebuilds them.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
log_prefix="c guests"
. "$here/../lib.sh" "$@"
tools="$root/target/guest-toolchains/c"

clang=clang-19
wasm_ld=/usr/lib/llvm-22/bin/wasm-ld
libc=/usr/lib/wasm32-wasi
command -v "$clang" >/dev/null || { log "$clang is missing: apt-get install clang-19"; exit 1; }
[ -x "$wasm_ld" ] || { log "$wasm_ld is missing: apt-get install lld-22"; exit 1; }
[ -f "$libc/libc.a" ] || { log "wasi-libc is missing: apt-get install wasi-libc"; exit 1; }
sysroot=$(rustup run stable rustc --print sysroot 2>/dev/null || rustc --print sysroot)
component_ld="$sysroot/lib/rustlib/x86_64-unknown-linux-gnu/bin/wasm-component-ld"
[ -x "$component_ld" ] || { log "wasm-component-ld not found at $component_ld"; exit 1; }

wit_bindgen="$tools/bin/wit-bindgen"
if [ ! -x "$wit_bindgen" ]; then
    log "installing wit-bindgen-cli 0.63.0 (C generator only) into $tools (about 2 minutes, once)"
    cargo install --quiet wit-bindgen-cli --version 0.63.0 --locked --debug \
        --no-default-features --features c --root "$tools"
fi
log "$("$wit_bindgen" --version), $("$clang" --version | head -1)"
mkdir -p "$out"

build() { # <source dir> <world> <output name>
    local src="$here/$1" world=$2 wasm="$out/$3.wasm"
    if up_to_date "$wasm" "$src" "$root/wit"; then
        log "$3: up to date"
        return
    fi
    local started=$SECONDS work="$tools/build/$3"
    rm -rf "$work" && mkdir -p "$work"
    local generated
    generated=$("$wit_bindgen" c "$root/wit" --world "$world" --out-dir "$work" 2>&1) \
        || { log "wit-bindgen c failed: $generated"; exit 1; }
    local objects=("$work/${world}_component_type.o") c object
    for c in "$work/$world.c" "$src"/*.c; do
        # The generated bindings are <world>.c, which a source may share a name with.
        object="$work/$(basename "$(dirname "$c")")-$(basename "$c" .c).o"
        "$clang" --target=wasm32-wasi -O2 -Wall -Werror -isystem /usr/include/wasm32-wasi \
            -I "$work" -c "$c" -o "$object"
        objects+=("$object")
    done
    "$component_ld" --wasm-ld-path "$wasm_ld" --wasi-adapter reactor --no-entry --strip-all \
        -o "$wasm.tmp" "$libc/crt1-reactor.o" "${objects[@]}" -L "$libc" -lc
    mv "$wasm.tmp" "$wasm"
    log "$3: built in $((SECONDS - started)) s, $(stat -c %s "$wasm") bytes"
}

build tool tool c-tool
