#!/usr/bin/env bash
# Build the VM test bed's own small kernel, with what Debian's kernels leave
# unset: IOMMUFD, VFIO_DEVICE_CDEV and the virtio-net VFIO variant driver.
#
# Debian's kernel source (linux-source-<ver> of KERNEL_SRC_SUITE, default
# trixie, fetched through the private apt configuration of
# scripts/lib/private-apt.sh; the machine's apt sources are never edited) is
# configured as x86_64 tinyconfig plus the fragment scripts/vm/kernel.config,
# built (vmlinux, bzImage, modules), and its modules installed into a tree
# that depmod indexes. The result is cached by a key over the fragment, the
# source package and version, and this build recipe, in
# ${VFIO_SANDBOX_CACHE:-$HOME/.cache/vfio-sandbox}/kernel/<key>/, outside the
# repository so that a fresh clone on the same machine (CI) finds it: the
# kernel is rebuilt only when one of those changes. Build tools (gcc, make,
# bc, bison, flex, libelf-dev, libssl-dev, xz-utils, kmod, cpio, python3,
# perl) are installed with apt-get when missing (scripts/lib/packages.sh:
# without recommended packages, never removing one). The build time and the
# load average before and after it are printed and kept in <key>/build-info.
# The download (about 150 MB), the unpacking and the compile (about 9 min on
# two cores) are silent: a line on stderr every 30 s says how far they are.
#
# Usage:  eval "$(scripts/build-kernel.sh)"
#
# Prints on stdout the same shell assignments as scripts/fetch-kernel.sh
# (KERNEL_PKG, KERNEL_PKG_VERSION, KERNEL_VERSION, KERNEL_IMAGE,
# KERNEL_VMLINUX, KERNEL_PVH, KERNEL_MODULES, KERNEL_CONFIG, KERNEL_SUITE,
# KERNEL_ARCH, KERNEL_BUSYBOX, KERNEL_KMOD, KERNEL_USERLAND), so the
# initramfs and QEMU parts of scripts/vm/run.sh use it unchanged; progress
# goes to stderr.
#
# Environment:
#   VFIO_SANDBOX_CACHE  cache root (default $HOME/.cache/vfio-sandbox)
#   KERNEL_SRC_SUITE    Debian suite of the source (default trixie)
#   KERNEL_SRC_PKG, KERNEL_SRC_VERSION   pin the source package (e.g.
#                       linux-source-6.12 and 6.12.117-1) instead of
#                       resolving the suite's linux-source
#   KERNEL_FRAGMENT     config fragment (default scripts/vm/kernel.config)
#   KERNEL_BUILD_JOBS   make -j (default: nproc)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${VFIO_SANDBOX_CACHE:-$HOME/.cache/vfio-sandbox}/kernel"
src_suite="${KERNEL_SRC_SUITE:-trixie}"
fragment="${KERNEL_FRAGMENT:-$repo_root/scripts/vm/kernel.config}"
jobs="${KERNEL_BUILD_JOBS:-$(nproc)}"
# Bump when the steps below change what a cached build holds.
recipe=1

log() { printf 'build-kernel: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

export DEBIAN_FRONTEND=noninteractive
[[ "$(dpkg --print-architecture 2>/dev/null)" == amd64 ]] ||
    die "builds an x86_64 kernel on an amd64 host only"
[[ -f "$fragment" ]] || die "no config fragment $fragment"
[[ "$src_suite" =~ ^[a-z][a-z0-9-]*$ ]] || die "bad KERNEL_SRC_SUITE $src_suite"
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || die "bad KERNEL_BUILD_JOBS $jobs"

# shellcheck source=scripts/lib/packages.sh
source "$repo_root/scripts/lib/packages.sh"
trap progress_stop EXIT

# ensure_build_tools -- install what a kernel build needs, when missing.
ensure_build_tools() {
    pkg_ensure build-kernel gcc:gcc make:make bc:bc bison:bison flex:flex \
        libelf-dev:/usr/include/libelf.h libssl-dev:/usr/include/openssl/ssl.h \
        xz-utils:xz kmod:depmod cpio:cpio python3:python3 perl:perl ||
        die "cannot install the kernel build tools"
}

# kernel_objects DIR [TOTAL] -- how many object files the build in DIR has,
# "of about TOTAL" when an earlier build said how many it made.
kernel_objects() {
    local n
    n="$(find "$1" -name '*.o' -type f 2>/dev/null | wc -l)"
    if [[ -n "${2:-}" ]]; then
        printf '%s of about %s object files\n' "$n" "$2"
    else
        printf '%s object files\n' "$n"
    fi
}

# shellcheck source=scripts/lib/private-apt.sh
source "$repo_root/scripts/lib/private-apt.sh"
apt_dir="$cache_root/apt-$src_suite"
private_apt_setup "$src_suite" "$apt_dir" main amd64 ||
    die "set PRIVATE_APT_MIRROR to the Debian archive to fetch $src_suite from"
apt_opts=("${PRIVATE_APT_OPTS[@]}")

# resolve_source -- print "<package> <version>" of the suite's linux-source,
# whose meta package pins it ("Depends: linux-source-6.12 (= 6.12.117-1)").
resolve_source() {
    apt-cache "${apt_opts[@]}" show --no-all-versions linux-source 2>/dev/null |
        awk -F': ' '$1 == "Depends" {
            n = split($2, deps, /, */)
            for (i = 1; i <= n; i++) if (deps[i] ~ /^linux-source-[0-9]/) {
                split(deps[i], w, /[ ()=]+/); print w[1], w[2]; exit
            }
        }'
}

mkdir -p "$cache_root"
exec 9>"$cache_root/.lock"
flock 9 # one build at a time on this machine; a second caller then finds it cached

pkg="${KERNEL_SRC_PKG:-}" ver="${KERNEL_SRC_VERSION:-}"
if [[ -z "$pkg" || -z "$ver" ]]; then
    if [[ -z "$(find "$apt_dir/lists" -maxdepth 1 -name '*_Packages*' -mtime -1 -print -quit 2>/dev/null)" ]]; then
        log "running apt-get update (private configuration for $src_suite)"
        progress_run "build-kernel: still updating the package lists" -- \
            apt-get "${apt_opts[@]}" update -qq >&2 || log "warning: apt-get update failed"
    fi
    read -r pkg ver < <(resolve_source || true) || true
fi
frag_sum="$(sha256sum "$fragment" | cut -c1-64)"
if [[ -z "${pkg:-}" || -z "${ver:-}" ]]; then
    # No package information (offline): the newest cached build of this fragment.
    cached="$(grep -lx "fragment=$frag_sum" "$cache_root"/*/build-info 2>/dev/null | xargs -r ls -t | head -n 1)"
    [[ -n "$cached" ]] || die "cannot resolve linux-source in $src_suite and nothing is cached"
    log "warning: cannot resolve linux-source in $src_suite; using the cached $(dirname "$cached")"
    cat "$(dirname "$cached")/kernel.env"
    exit 0
fi
key="$(printf 'recipe=%s\nsource=%s=%s\nfragment=%s\n' "$recipe" "$pkg" "$ver" "$frag_sum" | sha256sum | cut -c1-16)"
dest="$cache_root/$key"
if [[ -f "$dest/.complete" ]]; then
    log "cached: $pkg $ver with $(basename "$fragment") ($dest)"
    cat "$dest/kernel.env"
    exit 0
fi

ensure_build_tools

# fetch_source -- download and unpack linux-source (kept for rebuilds of
# other fragments); sets src to the unpacked tree.
fetch_source() {
    local srcdir="$cache_root/src/${pkg}_$ver" debdir="$cache_root/debs" deb tmp tarball size
    src="$srcdir/$pkg"
    [[ -f "$srcdir/.complete" ]] && return 0
    mkdir -p "$debdir"
    deb="$debdir/${pkg}_${ver//:/%3a}_all.deb"
    if [[ ! -f "$deb" ]]; then
        size="$(apt-cache "${apt_opts[@]}" show "$pkg=$ver" 2>/dev/null | awk -F': ' '$1 == "Size" { print $2; exit }')"
        log "downloading $pkg=$ver${size:+ ($((size / 1000000)) MB)}"
        tmp="$(mktemp -d "$debdir/.dl.XXXXXX")"
        if id _apt >/dev/null 2>&1; then chown _apt "$tmp" 2>/dev/null || true; fi
        progress_start "build-kernel: still downloading $pkg" progress_size_of "$size" "$tmp"
        (cd "$tmp" && apt-get "${apt_opts[@]}" download -q "$pkg=$ver" >&2) ||
            { progress_stop; rm -rf "$tmp"; die "apt-get download $pkg=$ver failed"; }
        progress_stop
        mv "$(find "$tmp" -maxdepth 1 -name '*.deb' -print -quit)" "$deb"
        rm -rf "$tmp"
    fi
    log "unpacking $(basename "$deb")"
    rm -rf "$srcdir"
    mkdir -p "$srcdir"
    tarball="$(dpkg-deb -c "$deb" | awk '{ print $NF }' | grep -m1 '^\./usr/src/linux-source-.*\.tar\.xz$')" ||
        die "no source tarball in $(basename "$deb")"
    progress_start "build-kernel: still unpacking $(basename "$deb")" progress_size "$srcdir"
    dpkg-deb --fsys-tarfile "$deb" | tar -xO "$tarball" | tar -xJ -C "$srcdir"
    progress_stop
    [[ -d "$src" ]] || die "$(basename "$deb") did not unpack to $src"
    touch "$srcdir/.complete"
    # One source tree and package at a time: drop the others.
    find "$cache_root/src" -mindepth 1 -maxdepth 1 ! -path "$srcdir" -exec rm -rf {} +
    find "$debdir" -maxdepth 1 -name '*.deb' ! -path "$deb" -delete
}
fetch_source

# The build: tinyconfig + fragment, every fragment line checked afterwards
# (Kconfig drops a symbol whose dependencies are unmet without a word).
# An interrupted build of the same key resumes in its build tree (make only
# redoes what is missing); anything else in it is made again.
work="$dest.tmp"
resumed=0
if [[ -d "$work/build" ]]; then
    resumed=1
    log "resuming the interrupted build in $work"
    find "$work" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
fi
mkdir -p "$work/build"
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
t0=$(date +%s)
log "building $pkg $ver with $(basename "$fragment") on $jobs cores (load before: $load_before)"
make -C "$src" -s O="$work/build" tinyconfig >&2
"$src/scripts/kconfig/merge_config.sh" -m -O "$work/build" "$work/build/.config" "$fragment" >/dev/null
make -C "$src" -s O="$work/build" olddefconfig >&2
unmet=()
while read -r line; do
    grep -qxF "$line" "$work/build/.config" || unmet+=("$line")
done < <(grep -E '^CONFIG_[A-Z0-9_]+=' "$fragment")
((${#unmet[@]} == 0)) || die "the fragment asks for what the configuration does not hold: ${unmet[*]}"
# The CPU time of the compile (user + system seconds) does not depend on what
# else runs on the machine: on an idle machine the wall time is about it
# divided by the cores.
TIMEFORMAT='%U %S'
# How many object files the newest earlier build made, for the progress line.
objects_before="$(find "$cache_root" -mindepth 2 -maxdepth 2 -name build-info -printf '%T@ %p\n' 2>/dev/null |
    sort -rn | head -n 1 | cut -d' ' -f2- | xargs -r sed -n 's/^objects=//p' || true)"
progress_start "build-kernel: still compiling" kernel_objects "$work/build" "$objects_before"
if ! { time nice -n 10 make -C "$src" -s O="$work/build" -j"$jobs" vmlinux bzImage modules \
    >"$work/make.log" 2>&1; } 2>"$work/make.time"; then
    progress_stop
    tail -n 40 "$work/make.log" >&2
    die "kernel build failed (log: $work/make.log)"
fi
progress_stop
objects="$(find "$work/build" -name '*.o' -type f | wc -l)"
kver="$(make -C "$src" -s O="$work/build" kernelrelease)"
make -C "$src" -s O="$work/build" INSTALL_MOD_PATH="$work" DEPMOD=true modules_install >&2
rm -f "$work/lib/modules/$kver/build" "$work/lib/modules/$kver/source"
depmod -b "$work" "$kver"
t1=$(date +%s)
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"
cp "$work/build/arch/x86/boot/bzImage" "$work/vmlinuz-$kver"
cp "$work/build/vmlinux" "$work/vmlinux"
cp "$work/build/.config" "$work/config-$kver"
rm -rf "$work/build"
cpu="$(awk '{ printf "%.0f", $1 + $2 }' "$work/make.time")"
log "built $kver in $((t1 - t0)) s on $jobs cores, compile CPU time $cpu s (load average before: $load_before; after: $load_after)"
{
    # A resumed build's times are those of its last part only.
    printf 'source=%s=%s\nfragment=%s\nresumed=%s\n' "$pkg" "$ver" "$frag_sum" "$resumed"
    printf 'build_seconds=%s\ncompile_cpu_seconds=%s\njobs=%s\nload_before=%s\nload_after=%s\nobjects=%s\n' \
        "$((t1 - t0))" "$cpu" "$jobs" "$load_before" "$load_after" "$objects"
} >"$work/build-info"
pvh=0
grep -qx 'CONFIG_PVH=y' "$work/config-$kver" && pvh=1
{
    printf 'KERNEL_PKG=%q\n' "$pkg"
    printf 'KERNEL_PKG_VERSION=%q\n' "$ver"
    printf 'KERNEL_VERSION=%q\n' "$kver"
    printf 'KERNEL_IMAGE=%q\n' "$dest/vmlinuz-$kver"
    printf 'KERNEL_VMLINUX=%q\n' "$dest/vmlinux"
    printf 'KERNEL_PVH=%q\n' "$pvh"
    printf 'KERNEL_MODULES=%q\n' "$dest/lib/modules/$kver"
    printf 'KERNEL_CONFIG=%q\n' "$dest/config-$kver"
    printf 'KERNEL_SUITE=%q\n' "$src_suite"
    printf 'KERNEL_ARCH=amd64\n'
    printf 'KERNEL_BUSYBOX=\nKERNEL_KMOD=\nKERNEL_USERLAND=\n'
} >"$work/kernel.env"
touch "$work/.complete"
rm -rf "$dest"
mv "$work" "$dest"
# Keep the three newest builds (other branches may use other fragments).
find "$cache_root" -mindepth 2 -maxdepth 2 -name .complete -printf '%T@ %h\n' | sort -rn |
    tail -n +4 | while read -r _ old; do
    log "removing old build $(basename "$old")"
    rm -rf "$old"
done
cat "$dest/kernel.env"
