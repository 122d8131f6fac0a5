#!/usr/bin/env bash
# Fetch a Debian distribution kernel for the VM test bed.
#
# Resolves the versioned package that `linux-image-amd64` of a Debian suite
# currently depends on (e.g. linux-image-6.1.0-56-amd64 at a pinned package
# version), downloads it once into <cache dir> (below: the machine's, not the
# checkout's, so a fresh clone fetches nothing; one call at a time per
# directory, under a lock beside it), unpacks it with
# `dpkg -x` and runs depmod on the unpacked tree (the package ships no
# modules.dep; its postinst normally makes one). A second call with the same
# resolved package is a no-op.
#
# The suite (KERNEL_SUITE) defaults to the machine's own release, resolved
# through the machine's apt configuration. Another suite (e.g. trixie on a
# bookworm machine) or another architecture (KERNEL_ARCH=arm64 on an amd64
# machine) goes through a private apt configuration under
# <cache dir>/apt/ (its own sources.list, package lists and cache, and the
# architecture, passed with -o Dir::... and -o APT::Architecture...); the
# machine's sources are never edited. Its archive is the one the machine's
# own apt sources use for its release (KERNEL_MIRROR overrides), signed by
# the machine's Debian archive keyring.
#
# For an architecture other than the machine's, the guest's userland must be
# of that architecture too: the same private configuration downloads
# busybox-static and kmod (with the shared libraries kmod needs) of the
# kernel's suite and architecture and unpacks them under
# <cache dir>/userland/ (KERNEL_BUSYBOX, KERNEL_KMOD, KERNEL_USERLAND below).
#
# Usage:  eval "$(scripts/fetch-kernel.sh)"
#
# Prints shell assignments on stdout (progress goes to stderr):
#   KERNEL_PKG          package name, e.g. linux-image-6.1.0-56-amd64
#   KERNEL_PKG_VERSION  package version, e.g. 6.1.192-2
#   KERNEL_VERSION      uname -r of the kernel, e.g. 6.1.0-56-amd64
#   KERNEL_IMAGE        path of the vmlinuz
#   KERNEL_VMLINUX      path of the uncompressed ELF vmlinux extracted from the
#                       vmlinuz, or empty when that was not possible
#   KERNEL_PVH          1 when the kernel has CONFIG_PVH=y, so QEMU can boot
#                       KERNEL_VMLINUX directly (PVH entry): under TCG this
#                       skips the slow in-guest decompression of the
#                       vmlinuz (XZ on Debian), several seconds per boot
#   KERNEL_MODULES      path of lib/modules/<KERNEL_VERSION> (with modules.dep;
#                       usr/lib/modules/... for merged-usr packages)
#   KERNEL_CONFIG       path of the kernel's config file
#   KERNEL_SUITE        the Debian suite the kernel came from
#   KERNEL_ARCH         its Debian architecture (amd64, arm64)
#   KERNEL_BUSYBOX      static busybox of KERNEL_ARCH, or empty: use the
#                       machine's own (same architecture)
#   KERNEL_KMOD         kmod binary of KERNEL_ARCH, or empty: the machine's
#   KERNEL_USERLAND     root of the unpacked userland packages (the shared
#                       libraries of KERNEL_KMOD), or empty
# The same lines are written to <cache dir>/kernel.env.
#
# Environment:
#   KERNEL_SUITE        Debian suite, e.g. bookworm or trixie (default: the
#                       machine's release, VERSION_CODENAME of /etc/os-release)
#   KERNEL_MIRROR       archive URI for a private suite (default: the one the
#                       machine's apt sources use for its own release)
#   KERNEL_ARCH         Debian architecture of the kernel (default: the
#                       machine's, dpkg --print-architecture)
#   KERNEL_CACHE_DIR    cache dir (default: ${VFIO_SANDBOX_CACHE:-$HOME/.cache/
#                       vfio-sandbox}/debian-kernel/<suite>, or <suite>-<arch>
#                       for another architecture)
#   KERNEL_META_PKG     meta package to resolve (default:
#                       linux-image-<arch>)
#   KERNEL_PKG, KERNEL_PKG_VERSION   pin an exact package instead of resolving
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
host_suite="$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null | tr -d '"' | head -n 1)"
suite="${KERNEL_SUITE:-$host_suite}"
[[ "$suite" =~ ^[a-z][a-z0-9-]*$ ]] ||
    { printf 'fetch-kernel: error: no Debian suite (set KERNEL_SUITE; /etc/os-release names none)\n' >&2; exit 1; }
host_arch="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
arch="${KERNEL_ARCH:-$host_arch}"
[[ "$arch" =~ ^[a-z0-9]+$ ]] ||
    { printf 'fetch-kernel: error: bad KERNEL_ARCH %s\n' "$arch" >&2; exit 1; }
kernels="${VFIO_SANDBOX_CACHE:-$HOME/.cache/vfio-sandbox}/debian-kernel"
if [[ "$arch" == "$host_arch" ]]; then
    cache_dir="${KERNEL_CACHE_DIR:-$kernels/$suite}"
else
    cache_dir="${KERNEL_CACHE_DIR:-$kernels/$suite-$arch}"
fi
# One call at a time per cache directory (two checkouts' suites on one
# machine): the lock is held until this script exits.
mkdir -p "$(dirname "$cache_dir")"
exec 8>"$cache_dir.lock"
flock 8
meta_pkg="${KERNEL_META_PKG:-linux-image-$arch}"

log() { printf 'fetch-kernel: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

export DEBIAN_FRONTEND=noninteractive

# Host packages (scripts/lib/packages.sh: only the missing ones, without
# recommended packages, never a removal) and a line on stderr every 30 s
# while a download is silent (scripts/lib/progress.sh, sourced by it).
# shellcheck source=scripts/lib/packages.sh
source "$repo_root/scripts/lib/packages.sh"
trap progress_stop EXIT

# Install missing host tools (dpkg-deb is part of dpkg; depmod is in kmod;
# xz/zstd only matter for compressed modules or packages).
ensure_tools() {
    command -v apt-get >/dev/null || die "apt-get not found (Debian-based host required)"
    command -v dpkg >/dev/null || die "dpkg not found"
    pkg_ensure fetch-kernel kmod:depmod xz-utils:xz || die "cannot install the tools above"
}

# The private apt configuration (sources, lists, cache, architecture) for a
# suite or architecture other than the machine's.
# shellcheck source=scripts/lib/private-apt.sh
source "$repo_root/scripts/lib/private-apt.sh"

# apt options: none for the machine's own suite and architecture; a private
# configuration (sources, lists, cache under the kernel cache, architecture)
# for any other.
apt_opts=()
apt_private=0
if [[ "$suite" != "$host_suite" || "$arch" != "$host_arch" ]]; then
    apt_private=1
    apt_dir="$cache_dir/apt"
    PRIVATE_APT_MIRROR="${KERNEL_MIRROR:-${PRIVATE_APT_MIRROR:-}}" \
        private_apt_setup "$suite" "$apt_dir" main "$arch" ||
        die "set KERNEL_MIRROR to the Debian archive to fetch $suite from"
    apt_opts=("${PRIVATE_APT_OPTS[@]}")
fi

apt_updated=0
apt_update_once() {
    if ((apt_updated == 0)); then
        if ((apt_private)); then
            log "running apt-get update (private configuration for $suite)"
        else
            log "running apt-get update"
        fi
        progress_run "fetch-kernel: still updating the package lists" -- \
            apt-get "${apt_opts[@]}" update -qq >&2 || log "warning: apt-get update failed"
        apt_updated=1
    fi
}

# Print "<package> <version>" for the versioned kernel package that the meta
# package depends on. One apt-cache call: the meta package pins the exact
# version ("Depends: linux-image-6.1.0-56-amd64 (= 6.1.192-2)"); when it does
# not, the version is left empty and resolved with apt-cache policy.
resolve_pkg() {
    apt-cache "${apt_opts[@]}" show --no-all-versions "$meta_pkg" 2>/dev/null |
        awk -F': ' '$1 == "Depends" {
            n = split($2, deps, /, */)
            for (i = 1; i <= n; i++) {
                if (deps[i] ~ /^linux-image-[0-9]/) {
                    split(deps[i], w, /[ ()=]+/)
                    print w[1], w[2]
                    exit
                }
            }
        }'
}

# Print the size in bytes of the .deb of PACKAGE=VERSION (empty when unknown).
deb_size() {
    apt-cache "${apt_opts[@]}" show "$1" 2>/dev/null | awk -F': ' '$1 == "Size" { print $2; exit }'
}

# Print the candidate version apt would install for a package.
resolve_version() {
    apt-cache "${apt_opts[@]}" policy "$1" 2>/dev/null | awk '$1 == "Candidate:" && $2 != "(none)" { print $2; exit }'
}

# extract_vmlinux BZIMAGE OUT -- decompress the ELF kernel inside a bzImage
# (xz, zstd or gzip payload). Fails when none of them yields an ELF file.
extract_vmlinux() {
    local img="$1" out="$2" magic tool off
    for spec in 'xz|\xfd7zXZ\x00' 'zstd|\x28\xb5\x2f\xfd' 'gzip|\x1f\x8b\x08'; do
        tool="${spec%%|*}"
        magic="${spec#*|}"
        command -v "$tool" >/dev/null || continue
        while read -r off; do
            [[ -n "$off" ]] || continue
            case "$tool" in
                xz) tail -c +"$((off + 1))" "$img" | xz -dc --single-stream >"$out.tmp" 2>/dev/null || true ;;
                zstd) tail -c +"$((off + 1))" "$img" | zstd -dcq >"$out.tmp" 2>/dev/null || true ;;
                gzip) tail -c +"$((off + 1))" "$img" | gzip -dc >"$out.tmp" 2>/dev/null || true ;;
            esac
            if [[ "$(head -c 4 "$out.tmp" | od -An -tx1 | tr -d ' \n')" == 7f454c46 ]]; then
                mv "$out.tmp" "$out"
                return 0
            fi
        done < <(LC_ALL=C grep -obUaP "$magic" "$img" 2>/dev/null | head -n 3 | cut -d: -f1)
    done
    rm -f "$out.tmp"
    return 1
}

depmod_bin() { command -v depmod || echo /sbin/depmod; }

# The newest complete extraction already in the cache, if any.
newest_cached() {
    local d best=""
    for d in "$cache_dir"/linux-image-*; do
        [[ -f "$d/.complete" ]] && best="$d"
    done
    [[ -n "$best" ]] && printf '%s\n' "$best"
}

ensure_tools
mkdir -p "$cache_dir"
# Private package lists: fetch them when missing or older than a day.
if ((apt_private)) && [[ -z "$(find "$apt_dir/lists" -maxdepth 1 -name '*_Packages*' -mtime -1 -print -quit)" ]]; then
    apt_update_once
fi

pkg="${KERNEL_PKG:-}"
ver="${KERNEL_PKG_VERSION:-}"
if [[ -z "$pkg" ]]; then
    read -r pkg ver < <(resolve_pkg || true) || true
    if [[ -z "${pkg:-}" ]]; then
        apt_update_once
        read -r pkg ver < <(resolve_pkg || true) || true
    fi
    pkg="${pkg:-}"
    ver="${ver:-}"
fi
if [[ -n "$pkg" && -z "$ver" ]]; then
    ver="$(resolve_version "$pkg" || true)"
    if [[ -z "$ver" ]]; then
        apt_update_once
        ver="$(resolve_version "$pkg" || true)"
    fi
fi

if [[ -z "$pkg" || -z "$ver" ]]; then
    # No package information at all: fall back to what is cached.
    if cached="$(newest_cached)"; then
        log "warning: cannot resolve $meta_pkg with apt; using cached $(basename "$cached")"
        dest="$cached"
    else
        die "cannot resolve the kernel package behind $meta_pkg (is apt configured?)"
    fi
else
    # ':' and '+' in Debian versions are fine in file names; '~' too.
    dest="$cache_dir/${pkg}_${ver}"
    if [[ ! -f "$dest/.complete" ]]; then
        debdir="$cache_dir/debs"
        mkdir -p "$debdir"
        deb="$(find "$debdir" -maxdepth 1 -name "${pkg}_*.deb" -print 2>/dev/null |
            while read -r f; do
                if [[ "$(dpkg-deb -f "$f" Version 2>/dev/null)" == "$ver" ]]; then
                    echo "$f"
                    break
                fi
            done)"
        if [[ -z "$deb" ]]; then
            log "downloading $pkg=$ver"
            tmp="$(mktemp -d "$debdir/.dl.XXXXXX")"
            # apt drops privileges to _apt for downloads; let it write here so
            # it does not warn about an unsandboxed download.
            if id _apt >/dev/null 2>&1; then chown _apt "$tmp" 2>/dev/null || true; fi
            size="$(deb_size "$pkg=$ver")"
            progress_start "fetch-kernel: still downloading $pkg" progress_size_of "$size" "$tmp"
            if ! (cd "$tmp" && apt-get "${apt_opts[@]}" download -q "$pkg=$ver" >&2); then
                progress_stop
                apt_update_once
                progress_start "fetch-kernel: still downloading $pkg" progress_size_of "$size" "$tmp"
                (cd "$tmp" && apt-get "${apt_opts[@]}" download -q "$pkg=$ver" >&2) ||
                    { progress_stop; rm -rf "$tmp"; die "apt-get download $pkg=$ver failed"; }
            fi
            progress_stop
            f="$(find "$tmp" -maxdepth 1 -name '*.deb' -print -quit)"
            [[ -n "$f" ]] || { rm -rf "$tmp"; die "download produced no .deb"; }
            deb="$debdir/$(basename "$f")"
            mv "$f" "$deb"
            rm -rf "$tmp"
        fi
        log "unpacking $(basename "$deb")"
        rm -rf "$dest" "$dest.tmp"
        mkdir -p "$dest.tmp"
        progress_run "fetch-kernel: still unpacking $(basename "$deb")" progress_size "$dest.tmp" -- \
            dpkg -x "$deb" "$dest.tmp"
        mv "$dest.tmp" "$dest"
        # Keep the cache bounded: drop other kernels once this one is complete.
        newdeb="$deb"
    fi
fi

# Locate the kernel version, image and modules in the unpacked tree.
moddir=""
for d in "$dest"/lib/modules/* "$dest"/usr/lib/modules/*; do
    [[ -d "$d/kernel" ]] && { moddir="$d"; break; }
done
[[ -n "$moddir" ]] || die "no lib/modules/<version>/kernel in $dest"
kver="$(basename "$moddir")"
image="$dest/boot/vmlinuz-$kver"
[[ -f "$image" ]] || die "no kernel image $image"
config="$dest/boot/config-$kver"

if [[ ! -f "$dest/.complete" ]]; then
    # depmod -b wants <base>/lib/modules/<ver>; usrmerged packages use usr/lib.
    base="${moddir%/lib/modules/*}"
    log "running depmod for $kver"
    "$(depmod_bin)" -b "$base" "$kver"
    if extract_vmlinux "$image" "$dest/vmlinux"; then
        log "extracted vmlinux"
    else
        log "warning: could not extract vmlinux from $(basename "$image"); VMs boot the vmlinuz"
    fi
    touch "$dest/.complete"
    if [[ -n "${newdeb:-}" ]]; then
        for old in "$cache_dir"/linux-image-*; do
            [[ "$old" == "$dest" ]] && continue
            log "removing old cached kernel $(basename "$old")"
            rm -rf "$old"
        done
        for old in "$cache_dir"/debs/*.deb; do
            [[ -e "$old" && "$old" != "$newdeb" ]] && rm -f "$old"
        done
    fi
fi
[[ -f "$moddir/modules.dep" ]] || die "no modules.dep in $moddir"

# The guest userland of a foreign architecture: busybox-static, kmod, and
# the libraries kmod links or dlopens (libkmod opens liblzma and libzstd for
# compressed modules only when it needs them, so they are named here), with
# every "lib*" package they depend on. Unpacked (dpkg -x) into one root.
userland="" busybox="" kmod=""
userland_pkgs() {
    local queue=(busybox-static kmod liblzma5 libzstd1) seen=" " p deps
    while ((${#queue[@]})); do
        p="${queue[0]}"
        queue=("${queue[@]:1}")
        [[ "$seen" == *" $p "* ]] && continue
        seen+="$p "
        printf '%s\n' "$p"
        deps="$(apt-cache "${apt_opts[@]}" show --no-all-versions "$p" 2>/dev/null |
            awk -F': ' '$1 == "Depends" || $1 == "Pre-Depends" {
                n = split($2, d, /, */)
                for (i = 1; i <= n; i++) { split(d[i], w, /[ :|(]+/); print w[1] }
            }')" || return 1
        for p in $deps; do
            [[ "$p" == lib* || "$p" == zlib* ]] && queue+=("$p")
        done
    done
}
if [[ "$arch" != "$host_arch" ]]; then
    userland="$cache_dir/userland"
    if [[ ! -f "$userland/.complete" ]]; then
        mapfile -t upkgs < <(userland_pkgs)
        ((${#upkgs[@]} > 4)) || { apt_update_once; mapfile -t upkgs < <(userland_pkgs); }
        log "downloading the $arch userland: ${upkgs[*]}"
        rm -rf "$userland" "$userland.tmp" "$cache_dir/userland-debs"
        mkdir -p "$userland.tmp" "$cache_dir/userland-debs"
        if id _apt >/dev/null 2>&1; then chown _apt "$cache_dir/userland-debs" 2>/dev/null || true; fi
        size="$(for p in "${upkgs[@]}"; do deb_size "$p"; done | awk '{ s += $1 } END { print s + 0 }')"
        progress_start "fetch-kernel: still downloading the $arch userland" progress_size_of "$size" "$cache_dir/userland-debs"
        (cd "$cache_dir/userland-debs" && apt-get "${apt_opts[@]}" download -q "${upkgs[@]}" >&2) ||
            { progress_stop; die "apt-get download of the $arch userland failed"; }
        progress_stop
        for f in "$cache_dir/userland-debs"/*.deb; do
            dpkg -x "$f" "$userland.tmp"
        done
        rm -rf "$cache_dir/userland-debs"
        touch "$userland.tmp/.complete"
        mv "$userland.tmp" "$userland"
    fi
    for f in "$userland"/bin/busybox "$userland"/usr/bin/busybox; do
        [[ -f "$f" && ! -L "$f" ]] && { busybox="$f"; break; }
    done
    for f in "$userland"/bin/kmod "$userland"/usr/bin/kmod; do
        [[ -f "$f" && ! -L "$f" ]] && { kmod="$f"; break; }
    done
    [[ -n "$busybox" && -n "$kmod" ]] || die "no busybox or kmod in $userland"
fi
vmlinux=""
[[ -f "$dest/vmlinux" ]] && vmlinux="$dest/vmlinux"
pvh=0
grep -qx 'CONFIG_PVH=y' "$config" 2>/dev/null && pvh=1

if [[ -z "$pkg" || -z "$ver" ]]; then
    name="$(basename "$dest")"
    pkg="${name%%_*}"
    ver="${name#*_}"
fi

env_out="$(
    printf 'KERNEL_PKG=%q\n' "$pkg"
    printf 'KERNEL_PKG_VERSION=%q\n' "$ver"
    printf 'KERNEL_VERSION=%q\n' "$kver"
    printf 'KERNEL_IMAGE=%q\n' "$image"
    printf 'KERNEL_VMLINUX=%q\n' "$vmlinux"
    printf 'KERNEL_PVH=%q\n' "$pvh"
    printf 'KERNEL_MODULES=%q\n' "$moddir"
    printf 'KERNEL_CONFIG=%q\n' "$config"
    printf 'KERNEL_SUITE=%q\n' "$suite"
    printf 'KERNEL_ARCH=%q\n' "$arch"
    printf 'KERNEL_BUSYBOX=%q\n' "$busybox"
    printf 'KERNEL_KMOD=%q\n' "$kmod"
    printf 'KERNEL_USERLAND=%q\n' "$userland"
)"
printf '%s\n' "$env_out" >"$cache_dir/kernel.env"
log "kernel $kver ($pkg $ver, $suite, $arch)"
printf '%s\n' "$env_out"
