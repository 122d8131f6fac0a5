#!/usr/bin/env bash
# Build the workspace binaries as static executables for the VM test bed.
#
#   RUSTFLAGS="-C target-feature=+crt-static" \
#     cargo build --release --target x86_64-unknown-linux-gnu --bins
#
# The explicit --target keeps these artifacts (and the RUSTFLAGS) apart from
# the normal target/release build cache.
#
# Prints the output directory (target/x86_64-unknown-linux-gnu/release) on
# stdout. Writes <output dir>/static-bins.list with the absolute path of every
# binary this build produced or found up to date, one per line. With
# --keep-going, binaries that compile are listed even when another one fails;
# the script then exits non-zero but the list is still valid.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="x86_64-unknown-linux-gnu"
target_dir="${CARGO_TARGET_DIR:-$repo_root/target}"
out_dir="$target_dir/$target/release"
list="$out_dir/static-bins.list"

log() { printf 'build-static: %s\n' "$*" >&2; }

command -v cargo >/dev/null || { log "error: cargo not found"; exit 1; }
# Static glibc linking needs libc.a (libc6-dev).
if [[ ! -e /usr/lib/x86_64-linux-gnu/libc.a ]] && command -v apt-get >/dev/null; then
    log "installing libc6-dev (static glibc)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libc6-dev >&2
fi
if command -v rustup >/dev/null && ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    log "adding rust target $target"
    rustup target add "$target" >&2
fi

mkdir -p "$out_dir"
json="$(mktemp)"
trap 'rm -f "$json"' EXIT

rc=0
# vfio-manager with its failpoints armed (FAILPOINTS env, `fail` crate), for the
# crash scenario only. Built first: the normal build below puts the shipped
# vfio-manager back in place (cargo keeps both variants cached).
fp_bin="$out_dir/vfio-manager-failpoints"
if (
    cd "$repo_root"
    RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C target-feature=+crt-static" \
        cargo build --release --target "$target" -p vfio-manager --features failpoints \
        --message-format=json-render-diagnostics
) >"$json"; then
    exe="$(grep -o '"executable":"[^"]*vfio-manager"' "$json" | tail -n1 | sed 's/^"executable":"//; s/"$//')"
    cp "$exe" "$fp_bin.tmp" && mv "$fp_bin.tmp" "$fp_bin"
else
    log "error: vfio-manager --features failpoints did not build"
    rm -f "$fp_bin"
    rc=1
fi
(
    cd "$repo_root"
    RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C target-feature=+crt-static" \
        cargo build --release --target "$target" --bins --keep-going \
        --message-format=json-render-diagnostics
) >"$json" || rc=$?

# Every compiler-artifact message with an "executable" is a binary that is
# current for this build (fresh or rebuilt).
grep -o '"executable":"[^"]*"' "$json" | sed 's/^"executable":"//; s/"$//' |
    sort -u >"$list.tmp" || true
if [[ -x "$fp_bin" ]]; then
    printf '%s\n' "$fp_bin" >>"$list.tmp"
fi
mv "$list.tmp" "$list"

if [[ -s "$list" ]]; then
    while read -r bin; do
        if command -v file >/dev/null && ! file -L "$bin" | grep -Eq 'statically linked|static-pie'; then
            log "warning: $bin does not look statically linked"
        fi
        log "built $(basename "$bin")"
    done <"$list"
else
    log "no binaries built"
fi
if ((rc != 0)); then
    log "error: cargo build failed (exit $rc); $(wc -l <"$list") binaries listed in $list"
fi
printf '%s\n' "$out_dir"
exit "$rc"
