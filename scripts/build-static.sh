#!/usr/bin/env bash
# Build the project's binaries as static executables for the VM test bed and
# the container image.
#
#   scripts/build-static.sh [--arch x86_64|aarch64] [--profile release|testbed|demo]
#                           [--packages "NAME ..."]
#
#   RUSTFLAGS="-C target-feature=+crt-static" \
#     cargo build --profile <profile> --target <arch>-unknown-linux-gnu --bins
#
# --arch (env STATIC_ARCH; also amd64/arm64) picks the target; the default is
# x86_64. --profile (env STATIC_PROFILE, default release) picks the cargo
# profile: `release` for the image, `testbed` (release without LTO, see
# Cargo.toml) for the VM test bed, `demo` (no optimisation) for scripts/demo.sh.
# Without --packages it builds what the test bed and the image take: the five
# shipped binaries, the two stand-ins the guest runs (kubelet-peer,
# fake-apiserver) and the failpoints variants; not the host-side test
# harnesses (tests/k8s, tests/bench), which nothing runs from a static build.
# --packages (env STATIC_PACKAGES) builds only those packages' binaries, and
# then no failpoints variants. The explicit --target keeps these artifacts (and the RUSTFLAGS)
# apart from the normal target/release build cache; build scripts and proc
# macros are host code and shared between both targets.
#
# aarch64 is cross-compiled with Debian's cross toolchain
# (gcc-aarch64-linux-gnu for linking and for C code of dependencies,
# libc6-dev-arm64-cross for the static glibc), installed with apt-get when
# missing, like the rust target (rustup target add). The linker and the
# target's C compiler and archiver are set through
# CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER, CC_aarch64_unknown_linux_gnu
# and AR_aarch64_unknown_linux_gnu unless already set.
#
# Prints the output directory (target/<arch>-unknown-linux-gnu/<profile>) on
# stdout. Writes <output dir>/static-bins.list with the absolute path of every
# binary this build produced or found up to date, one per line. With
# --keep-going, binaries that compile are listed even when another one fails;
# the script then exits non-zero but the list is still valid. A binary that
# is not static or not of the asked architecture (checked with `file`) fails
# the build.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
arch="${STATIC_ARCH:-x86_64}"
profile="${STATIC_PROFILE:-release}"
packages="${STATIC_PACKAGES:-}"
while (($#)); do
    case "$1" in
        --packages) packages="${2?--packages needs a list}"; shift 2 ;;
        --packages=*) packages="${1#*=}"; shift ;;
        --profile) profile="${2:?--profile needs release or testbed}"; shift 2 ;;
        --profile=*) profile="${1#*=}"; shift ;;
        --arch) arch="${2:?--arch needs x86_64 or aarch64}"; shift 2 ;;
        --arch=*) arch="${1#*=}"; shift ;;
        -h | --help) sed -n '2,/^set -euo/{/^#/!d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) printf 'build-static: error: unknown argument %s (see --help)\n' "$1" >&2; exit 2 ;;
    esac
done
case "$arch" in
    x86_64 | amd64) arch=x86_64 deb_arch=amd64 file_arch='x86-64' ;;
    aarch64 | arm64) arch=aarch64 deb_arch=arm64 file_arch='ARM aarch64' ;;
    *) printf 'build-static: error: --arch wants x86_64 or aarch64, got %s\n' "$arch" >&2; exit 2 ;;
esac
target="$arch-unknown-linux-gnu"
target_dir="${CARGO_TARGET_DIR:-$repo_root/target}"
case "$profile" in
    release | testbed | demo) ;;
    *) printf 'build-static: error: --profile wants release, testbed or demo, got %s\n' "$profile" >&2; exit 2 ;;
esac
out_dir="$target_dir/$target/$profile"
list="$out_dir/static-bins.list"

log() { printf 'build-static: %s\n' "$*" >&2; }

command -v cargo >/dev/null || { log "error: cargo not found"; exit 1; }
# Debian packages, only when missing, without recommended ones, never
# removing one (scripts/lib/packages.sh).
# shellcheck source=scripts/lib/packages.sh
source "$repo_root/scripts/lib/packages.sh"
apt_install() {
    pkg_ensure build-static "$@" || exit 1
}
if [[ "$arch" == "$(uname -m)" ]]; then
    # Static glibc linking needs libc.a (libc6-dev).
    if [[ ! -e "/usr/lib/$arch-linux-gnu/libc.a" ]] && command -v apt-get >/dev/null; then
        apt_install "libc6-dev:/usr/lib/$arch-linux-gnu/libc.a"
    fi
else
    # Cross build: Debian's cross gcc links and compiles C code for the
    # target (ring, with kube-rs/rustls, builds C); its libc.a links statically.
    cross="$arch-linux-gnu"
    apt_install "gcc-$cross:$cross-gcc" "libc6-dev-$deb_arch-cross:/usr/$cross/lib/libc.a"
    tvar="${target//-/_}"
    linker_var="CARGO_TARGET_${tvar^^}_LINKER"
    export "$linker_var=${!linker_var:-$cross-gcc}"
    cc_var="CC_$tvar" ar_var="AR_$tvar"
    export "$cc_var=${!cc_var:-$cross-gcc}" "$ar_var=${!ar_var:-$cross-ar}"
fi
if command -v rustup >/dev/null && ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    log "adding rust target $target"
    rustup target add "$target" >&2
fi

mkdir -p "$out_dir"
json="$(mktemp)"
trap 'rm -f "$json"' EXIT

rc=0
# vfio-manager and sandbox-dra-driver with their failpoints armed (FAILPOINTS env,
# `fail` crate), for the crash scenarios only, shipped as <name>-failpoints. Built
# first, with exactly the packages of the normal build below, so cargo resolves
# the same features for every dependency and the second build compiles only the
# two binaries' own crates again (the libraries take no feature for it, see
# support::failpoint); it also puts the shipped binaries back in place (cargo
# keeps both variants cached).
fp_bins=()
package_args=()
for p in ${packages:-vfio-manager sandbox-validator sandbox-device-plugin sandbox-dra-driver sandbox-dra-controller kubelet-peer fake-apiserver}; do
    package_args+=(-p "$p")
done
build() {
    (
        cd "$repo_root"
        RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C target-feature=+crt-static" \
            cargo build --profile "$profile" --target "$target" "${package_args[@]}" --bins --keep-going \
            --message-format=json-render-diagnostics "$@"
    ) >"$json"
}
if [[ -n "$packages" ]]; then
    : # only the packages asked for: no failpoints variants
elif build --features vfio-manager/failpoints,sandbox-dra-driver/failpoints; then
    for name in vfio-manager sandbox-dra-driver; do
        exe="$(grep -o "\"executable\":\"[^\"]*/$name\"" "$json" | tail -n1 | sed 's/^"executable":"//; s/"$//')"
        fp_bin="$out_dir/$name-failpoints"
        if [[ -n "$exe" ]] && cp "$exe" "$fp_bin.tmp" && mv "$fp_bin.tmp" "$fp_bin"; then
            fp_bins+=("$fp_bin")
        else
            log "error: $name --features failpoints built no binary"
            rc=1
        fi
    done
else
    log "error: the build with vfio-manager's and sandbox-dra-driver's failpoints failed"
    rm -f "$out_dir/vfio-manager-failpoints" "$out_dir/sandbox-dra-driver-failpoints"
    rc=1
fi
build || rc=$?

# Every compiler-artifact message with an "executable" is a binary that is
# current for this build (fresh or rebuilt).
grep -o '"executable":"[^"]*"' "$json" | sed 's/^"executable":"//; s/"$//' |
    sort -u >"$list.tmp" || true
for fp_bin in "${fp_bins[@]}"; do
    printf '%s\n' "$fp_bin" >>"$list.tmp"
done
mv "$list.tmp" "$list"

if [[ -s "$list" ]]; then
    apt_install file:file
    while read -r bin; do
        desc="$(file -L "$bin")"
        if ! grep -Eq 'statically linked|static-pie' <<<"$desc"; then
            log "error: $bin is not statically linked: $desc"
            rc=1
        elif ! grep -q "$file_arch" <<<"$desc"; then
            log "error: $bin is not an $file_arch executable: $desc"
            rc=1
        else
            log "built $(basename "$bin") (static, $file_arch)"
        fi
    done <"$list"
else
    log "no binaries built"
fi
if ((rc != 0)); then
    log "error: cargo build failed (exit $rc); $(wc -l <"$list") binaries listed in $list"
fi
printf '%s\n' "$out_dir"
exit "$rc"
