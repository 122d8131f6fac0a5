#!/usr/bin/env bash
# Fetch the QEMU that runs inside the test bed's guests, as a VMM would on a
# node: Debian 13's qemu-system-x86 (or qemu-system-arm), QEMU 10.0. Debian
# 12's QEMU 7.2 has no iommufd backend (`-object iommufd` came in QEMU 9.0),
# so one QEMU serves every guest kernel, legacy VFIO and iommufd alike.
#
# Usage:  eval "$(scripts/vm/fetch-qemu.sh [--arch amd64|arm64])"
#
# Downloads the package, the firmware the x86 machine loads at start
# (seabios: bios-256k.bin; qemu-system-data: kvmvapic.bin, which the PC
# machines load even under TCG) and every "lib*" package they depend on, through a
# private apt configuration (scripts/lib/private-apt.sh; the machine's apt
# sources stay untouched), unpacks them, and writes one uncompressed newc cpio
# archive that run.sh appends to the initramfs of a scenario that asks for
# QEMU (`# vm: needs=qemu`). The archive holds
#   /opt/qemu/bin/qemu-system-<arch>   the emulator, as packaged
#   /opt/qemu/lib/                      the shared libraries it links (the
#                                       closure of its DT_NEEDED entries)
#                                       with Debian 13's glibc and loader
#   /opt/qemu/share/                    firmware (x86: bios-256k.bin,
#                                       kvmvapic.bin)
#   /usr/bin/qemu-system-<arch>         a wrapper that starts it through
#                                       that loader, with -L /opt/qemu/share
# The guest's own /lib (the host's glibc, for kmod) is left alone.
#
# Cached under ${VFIO_SANDBOX_CACHE:-~/.cache/vfio-sandbox}/guest-qemu/
# trixie-<arch>/ (one call at a time, under a lock beside it); a second call
# downloads nothing. Prints on stdout:
#   GUEST_QEMU_CPIO     the archive
#   GUEST_QEMU_VERSION  the package version
#   GUEST_QEMU_BINARY   the wrapper's path inside the guest
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$here/../.." && pwd)"
arch=amd64
while (($#)); do
    case "$1" in
        --arch) arch="${2:?--arch needs amd64 or arm64}"; shift ;;
        --arch=*) arch="${1#--arch=}" ;;
        -h | --help) sed -n '2,/^set -euo/{/^#/!d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) printf 'fetch-qemu: error: unknown argument %s\n' "$1" >&2; exit 2 ;;
    esac
    shift
done
case "$arch" in
    amd64) pkg=qemu-system-x86 bin=qemu-system-x86_64 triplet=x86_64-linux-gnu firmware=(seabios qemu-system-data) ;;
    arm64) pkg=qemu-system-arm bin=qemu-system-aarch64 triplet=aarch64-linux-gnu firmware=() ;;
    *) printf 'fetch-qemu: error: --arch wants amd64 or arm64, got %s\n' "$arch" >&2; exit 2 ;;
esac
suite=trixie

log() { printf 'fetch-qemu: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

cache_dir="${VFIO_SANDBOX_CACHE:-$HOME/.cache/vfio-sandbox}/guest-qemu/$suite-$arch"
mkdir -p "$(dirname "$cache_dir")"
exec 8>"$cache_dir.lock"
flock 8

# shellcheck source=scripts/lib/packages.sh
source "$repo_root/scripts/lib/packages.sh"
trap progress_stop EXIT
# shellcheck source=scripts/lib/private-apt.sh
source "$repo_root/scripts/lib/private-apt.sh"
pkg_ensure fetch-qemu binutils:readelf cpio:cpio || die "cannot install the tools above"

archive="$cache_dir/qemu.cpio"
if [[ ! -f "$cache_dir/.complete" ]]; then
    export DEBIAN_FRONTEND=noninteractive
    private_apt_setup "$suite" "$cache_dir/apt" main "$arch" ||
        die "the machine's apt sources name no Debian archive to fetch $suite from"
    apt_opts=("${PRIVATE_APT_OPTS[@]}")
    log "running apt-get update (private configuration for $suite $arch)"
    progress_run "fetch-qemu: still updating the package lists" -- \
        apt-get "${apt_opts[@]}" update -qq >&2 || die "apt-get update failed"

    # The package, its firmware, and every lib* package in the closure of
    # their Depends (the libraries; qemu-system-common and -data hold nothing
    # the emulator needs paused with -nodefaults).
    pkgs=()
    queue=("$pkg" "${firmware[@]}")
    seen=" "
    while ((${#queue[@]})); do
        p="${queue[0]}"
        queue=("${queue[@]:1}")
        [[ "$seen" == *" $p "* ]] && continue
        seen+="$p "
        pkgs+=("$p")
        deps="$(apt-cache "${apt_opts[@]}" show --no-all-versions "$p" 2>/dev/null |
            awk -F': ' '$1 == "Depends" || $1 == "Pre-Depends" {
                n = split($2, d, /, */)
                for (i = 1; i <= n; i++) { split(d[i], w, /[ :|(]+/); print w[1] }
            }')" || die "apt-cache show $p failed"
        for d in $deps; do
            [[ "$d" == lib* || "$d" == zlib* ]] && queue+=("$d")
        done
    done
    version="$(apt-cache "${apt_opts[@]}" show --no-all-versions "$pkg" | awk -F': ' '$1 == "Version" { print $2; exit }')"
    [[ -n "$version" ]] || die "no $pkg in $suite for $arch"
    size="$(apt-cache "${apt_opts[@]}" show --no-all-versions "${pkgs[@]}" 2>/dev/null |
        awk -F': ' '$1 == "Size" { s += $2 } END { print s + 0 }')"
    log "downloading $pkg $version and ${#pkgs[@]} packages in all ($((size / 1048576)) MB)"
    rm -rf "$cache_dir/debs" "$cache_dir/root" "$cache_dir/stage"
    mkdir -p "$cache_dir/debs" "$cache_dir/root"
    if id _apt >/dev/null 2>&1; then chown _apt "$cache_dir/debs" 2>/dev/null || true; fi
    progress_start "fetch-qemu: still downloading" progress_size_of "$size" "$cache_dir/debs"
    (cd "$cache_dir/debs" && apt-get "${apt_opts[@]}" download -q "${pkgs[@]}" >&2) ||
        { progress_stop; die "apt-get download failed"; }
    progress_stop
    for f in "$cache_dir/debs"/*.deb; do dpkg -x "$f" "$cache_dir/root"; done
    rm -rf "$cache_dir/debs"

    root="$cache_dir/root"
    stage="$cache_dir/stage"
    mkdir -p "$stage/opt/qemu/bin" "$stage/opt/qemu/lib" "$stage/opt/qemu/share" "$stage/usr/bin"
    [[ -f "$root/usr/bin/$bin" ]] || die "$pkg has no usr/bin/$bin"
    cp "$root/usr/bin/$bin" "$stage/opt/qemu/bin/$bin"
    # find_lib NAME -- the path of a shared library in the unpacked packages.
    find_lib() {
        local d
        for d in "$root/usr/lib/$triplet" "$root/lib/$triplet" "$root/usr/lib" "$root/lib"; do
            if [[ -e "$d/$1" ]]; then
                printf '%s\n' "$d/$1"
                return 0
            fi
        done
        return 1
    }
    needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]$/\1/p'; }
    interp="$(readelf -l "$root/usr/bin/$bin" | sed -n 's/.*Requesting program interpreter: \(.*\)]$/\1/p')"
    [[ -n "$interp" ]] || die "$bin names no program interpreter"
    todo=("$(basename "$interp")")
    while read -r l; do todo+=("$l"); done < <(needed "$root/usr/bin/$bin")
    while ((${#todo[@]})); do
        l="${todo[0]}"
        todo=("${todo[@]:1}")
        [[ -e "$stage/opt/qemu/lib/$l" ]] && continue
        path="$(find_lib "$l")" || die "$bin needs $l, which no downloaded package holds"
        cp -L "$path" "$stage/opt/qemu/lib/$l"
        while read -r n; do todo+=("$n"); done < <(needed "$path")
    done
    if [[ "$arch" == amd64 ]]; then
        for fw in "$root/usr/share/seabios/bios-256k.bin" "$root/usr/share/qemu/kvmvapic.bin"; do
            [[ -f "$fw" ]] || die "no $(basename "$fw") in the downloaded packages"
            cp -L "$fw" "$stage/opt/qemu/share/"
        done
    fi
    cat >"$stage/usr/bin/$bin" <<EOF
#!/bin/sh
# Debian $suite's $bin $version, with its own glibc (fetch-qemu.sh).
exec /opt/qemu/lib/$(basename "$interp") --library-path /opt/qemu/lib /opt/qemu/bin/$bin -L /opt/qemu/share "\$@"
EOF
    chmod 0755 "$stage/usr/bin/$bin"
    (cd "$stage" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$archive.tmp"
    mv "$archive.tmp" "$archive"
    printf '%s\n' "$version" >"$cache_dir/version"
    rm -rf "$root" "$stage"
    touch "$cache_dir/.complete"
    log "$bin $version with $(find "$cache_dir" -maxdepth 0 >/dev/null; cpio -it --quiet <"$archive" | grep -c '^opt/qemu/lib/') libraries: $(du -h "$archive" | cut -f1)"
fi
printf 'GUEST_QEMU_CPIO=%q\n' "$archive"
printf 'GUEST_QEMU_VERSION=%q\n' "$(cat "$cache_dir/version")"
printf 'GUEST_QEMU_BINARY=%q\n' "/usr/bin/$bin"
