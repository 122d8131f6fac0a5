#!/usr/bin/env bash
# Build the multi-arch FROM-scratch runtime image (linux/amd64 and
# linux/arm64) from static binaries built on this host (Dockerfile target
# `runtime-prebuilt`) with buildah, join the two in a manifest list, then
# prove them: list what each image holds, run each binary, print each size.
#
#   scripts/image.sh [--tag IMAGE] [--archive FILE] [--arch LIST]
#
#   --tag IMAGE     name of the manifest list (env IMAGE; default
#                   localhost/vfio-sandbox:<workspace version>, the name the
#                   manifests use); the per-architecture images are
#                   IMAGE-amd64 and IMAGE-arm64
#   --archive FILE  also write the whole list (index and both images) as an
#                   OCI archive, e.g. to load it on a node without a registry
#                   (containerd picks the node's platform from the index):
#                     ctr -n k8s.io images import FILE
#   --arch LIST     architectures, comma-separated (env IMAGE_ARCHS; default
#                   amd64,arm64)
#
# The binaries come from scripts/build-static.sh, aarch64 cross-compiled with
# Debian's cross gcc. Each architecture is one `buildah bud --platform
# linux/<arch>` over a context with bin/<arch>/; the Dockerfile stage is
# COPY only, so building the arm64 image needs no emulation. A binary of the
# host's architecture runs inside its image (buildah run); a foreign one is
# checked with `file` (static, right machine) and, when Debian's
# qemu-user-static is installed, run with qemu-<arch>-static from the image's
# root filesystem.
#
# Needs root (buildah with the vfs storage driver and chroot isolation, which
# work without overlayfs or user namespaces); installs Debian's buildah when it
# is missing. Storage driver: env BUILDAH_STORAGE_DRIVER (default vfs).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf 'image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

version="$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$repo_root/Cargo.toml")"
[[ -n "$version" ]] || die "no version in [workspace.package] of Cargo.toml"
image="${IMAGE:-localhost/vfio-sandbox:$version}"
archive=""
arch_list="${IMAGE_ARCHS:-amd64,arm64}"
while (($#)); do
    case "$1" in
        --tag) image="${2:?--tag needs a value}"; shift 2 ;;
        --tag=*) image="${1#*=}"; shift ;;
        --archive) archive="${2:?--archive needs a value}"; shift 2 ;;
        --archive=*) archive="${1#*=}"; shift ;;
        --arch) arch_list="${2:?--arch needs a value}"; shift 2 ;;
        --arch=*) arch_list="${1#*=}"; shift ;;
        -h|--help) sed -n '2,/^set -euo/{/^#/!d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
IFS=, read -r -a archs <<<"$arch_list"
((${#archs[@]})) || die "--arch names no architecture"
for a in "${archs[@]}"; do
    [[ "$a" == amd64 || "$a" == arm64 ]] || die "--arch wants amd64 and/or arm64, got '$a'"
done
revision="$(git -C "$repo_root" rev-parse HEAD 2>/dev/null || echo unknown)"
host_arch="$(dpkg --print-architecture 2>/dev/null || echo amd64)"

if ! command -v buildah >/dev/null; then
    if ((EUID != 0)) || ! command -v apt-get >/dev/null; then
        die "buildah not found (install Debian's buildah package)"
    fi
    log "installing buildah"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >&2
fi
bh=(buildah --storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")

# Debian architecture -> the build-static.sh / QEMU / `file` names.
rust_arch() { case "$1" in amd64) echo x86_64 ;; arm64) echo aarch64 ;; esac; }
file_arch() { case "$1" in amd64) echo x86-64 ;; arm64) echo 'ARM aarch64' ;; esac; }

# 1. A build context holding bin/<arch>/<binary>, from one static build per
# architecture.
ctx="$(mktemp -d)"
ctr=""
mnt=""
cleanup() {
    [[ -n "$mnt" ]] && "${bh[@]}" umount "$ctr" >/dev/null 2>&1
    [[ -n "$ctr" ]] && "${bh[@]}" rm "$ctr" >/dev/null 2>&1
    rm -rf "$ctx"
}
trap cleanup EXIT
declare -A arch_bins=()
for a in "${archs[@]}"; do
    out_dir="$("$repo_root/scripts/build-static.sh" --arch "$(rust_arch "$a")")"
    list="$out_dir/static-bins.list"
    [[ -s "$list" ]] || die "no binaries listed in $list"
    mkdir -p "$ctx/bin/$a"
    bins=()
    while read -r bin; do
        # The node agents only: test tools (kubelet-peer, plugin-bench) stay out.
        case "$(basename "$bin")" in
            vfio-manager | sandbox-validator | sandbox-device-plugin | sandbox-dra-driver) ;;
            *) continue ;;
        esac
        cp "$bin" "$ctx/bin/$a/"
        bins+=("$(basename "$bin")")
    done <"$list"
    ((${#bins[@]} == 4)) || die "$a: expected 4 node agents, got: ${bins[*]}"
    arch_bins[$a]="${bins[*]}"
    log "$a binaries: ${bins[*]}"
done

# 2. One image per architecture, then the manifest list.
for a in "${archs[@]}"; do
    log "building $image-$a (target runtime-prebuilt, linux/$a)"
    previous="$("${bh[@]}" images --quiet --no-trunc "$image-$a" 2>/dev/null | head -n1 || true)"
    # TARGETARCH and BUILDARCH are also passed explicitly: buildah versions
    # differ in which platform arguments they set on their own.
    "${bh[@]}" bud --isolation chroot --quiet --platform "linux/$a" \
        -f "$repo_root/Dockerfile" --target runtime-prebuilt \
        --build-arg "TARGETARCH=$a" --build-arg "BUILDARCH=$host_arch" \
        --build-arg "VERSION=$version" --build-arg "REVISION=$revision" \
        -t "$image-$a" "$ctx" >/dev/null
    current="$("${bh[@]}" images --quiet --no-trunc "$image-$a" | head -n1)"
    # A rebuild moves the tag; drop the image it left behind (unless still used).
    if [[ -n "$previous" && "$previous" != "$current" ]]; then
        "${bh[@]}" rmi "$previous" >/dev/null 2>&1 || true
    fi
done
# The list is made afresh each time; the old one (a list, or a single image
# left by an earlier version of this script) goes first.
if "${bh[@]}" manifest inspect "$image" >/dev/null 2>&1; then
    "${bh[@]}" manifest rm "$image" >/dev/null 2>&1 || true
fi
"${bh[@]}" rmi "$image" >/dev/null 2>&1 || true
"${bh[@]}" manifest create "$image" >/dev/null
for a in "${archs[@]}"; do
    "${bh[@]}" manifest add --os linux --arch "$a" "$image" "containers-storage:$image-$a" >/dev/null
done

# 3. Proof, per architecture. What the image holds, listed before anything
# runs in it (running adds mount points such as /proc and /etc/hosts to the
# working container).
declare -A sizes=()
for a in "${archs[@]}"; do
    read -r -a bins <<<"${arch_bins[$a]}"
    printf '==== %s-%s (linux/%s)\n' "$image" "$a" "$a"
    printf 'platform: %s/%s\n' \
        "$("${bh[@]}" inspect --type image --format '{{.OCIv1.OS}}' "$image-$a")" \
        "$("${bh[@]}" inspect --type image --format '{{.OCIv1.Architecture}}' "$image-$a")"
    ctr="$("${bh[@]}" from --pull-never --platform "linux/$a" "$image-$a")"
    mnt="$("${bh[@]}" mount "$ctr")"
    printf 'contents:\n'
    (cd "$mnt" && find . -mindepth 1 | sort | sed 's/^\./  /')
    rootfs_bytes="$(du -sb "$mnt" | cut -f1)"
    for b in "${bins[@]}"; do
        desc="$(file -b "$mnt/usr/bin/$b")"
        printf '%s: %s\n' "$b" "$desc"
        grep -Eq 'statically linked|static-pie' <<<"$desc" || die "$a/$b is not statically linked"
        grep -q "$(file_arch "$a")" <<<"$desc" || die "$a/$b is not a $(file_arch "$a") executable"
    done
    if [[ "$a" != "$host_arch" ]]; then
        # Foreign binaries: user-mode emulation straight from the root
        # filesystem, when Debian's qemu-user-static is there.
        qemu_user="qemu-$(rust_arch "$a")-static"
        if command -v "$qemu_user" >/dev/null; then
            for b in "${bins[@]}"; do
                printf '$ %s %s --version\n' "$qemu_user" "$b"
                "$qemu_user" "$mnt/usr/bin/$b" --version
            done
        else
            printf 'not run: %s not installed (Debian qemu-user-static); checked with file only\n' "$qemu_user"
        fi
    fi
    "${bh[@]}" umount "$ctr" >/dev/null
    mnt=""
    if [[ "$a" == "$host_arch" ]]; then
        # Every binary runs inside the image (no shell there: direct exec).
        for b in "${bins[@]}"; do
            printf '$ %s --version\n' "$b"
            "${bh[@]}" run --isolation chroot "$ctr" -- "$b" --version
        done
        printf '$ vfio-manager --help\n'
        "${bh[@]}" run --isolation chroot "$ctr" -- vfio-manager --help
    fi
    "${bh[@]}" rm "$ctr" >/dev/null
    ctr=""

    printf 'image config: user=%s cmd=%s\n' \
        "$("${bh[@]}" inspect --type image --format '{{.OCIv1.Config.User}}' "$image-$a")" \
        "$("${bh[@]}" inspect --type image --format '{{.OCIv1.Config.Cmd}}' "$image-$a")"
    printf 'labels: %s\n' \
        "$("${bh[@]}" inspect --type image --format '{{.OCIv1.Config.Labels}}' "$image-$a")"
    sizes[$a]="$("${bh[@]}" images --format '{{.Size}}' "$image-$a" | head -n1) (root filesystem $rootfs_bytes bytes)"
done

printf '==== manifest list %s\n' "$image"
"${bh[@]}" manifest inspect "$image" |
    awk -F'"' '/"architecture"/ { a = $4 } /"os"/ { print "  " $4 "/" a }'
for a in "${archs[@]}"; do
    printf 'image size linux/%s: %s\n' "$a" "${sizes[$a]}"
done

if [[ -n "$archive" ]]; then
    mkdir -p "$(dirname "$archive")"
    rm -f "$archive"
    "${bh[@]}" manifest push --quiet --all "$image" "oci-archive:$archive:$image" >/dev/null
    printf 'archive: %s (OCI archive, %s platforms, %s bytes)\n' "$archive" "${#archs[@]}" "$(stat -c %s "$archive")"
fi
