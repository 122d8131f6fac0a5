#!/usr/bin/env bash
# Build the FROM-scratch runtime image from static binaries built on this host
# (Dockerfile target `runtime-prebuilt`) with buildah, then prove it: run each
# binary inside the image, list what the image holds, print its size.
#
#   scripts/image.sh [--tag IMAGE] [--archive FILE]
#
#   --tag IMAGE     image name (env IMAGE; default
#                   localhost/vfio-sandbox:<workspace version>, the name the
#                   manifests use)
#   --archive FILE  also write the image as a docker-archive tarball, e.g. to
#                   load it on a node without a registry:
#                     ctr -n k8s.io images import FILE
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
while (($#)); do
    case "$1" in
        --tag) image="${2:?--tag needs a value}"; shift 2 ;;
        --tag=*) image="${1#*=}"; shift ;;
        --archive) archive="${2:?--archive needs a value}"; shift 2 ;;
        --archive=*) archive="${1#*=}"; shift ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
revision="$(git -C "$repo_root" rev-parse HEAD 2>/dev/null || echo unknown)"

if ! command -v buildah >/dev/null; then
    if ((EUID != 0)) || ! command -v apt-get >/dev/null; then
        die "buildah not found (install Debian's buildah package)"
    fi
    log "installing buildah"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >&2
fi
bh=(buildah --storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")

# 1. Static binaries, built on the host.
out_dir="$("$repo_root/scripts/build-static.sh")"
list="$out_dir/static-bins.list"
[[ -s "$list" ]] || die "no binaries listed in $list"

# 2. A build context holding only bin/<binary>.
ctx="$(mktemp -d)"
ctr=""
mnt=""
cleanup() {
    [[ -n "$mnt" ]] && "${bh[@]}" umount "$ctr" >/dev/null 2>&1
    [[ -n "$ctr" ]] && "${bh[@]}" rm "$ctr" >/dev/null 2>&1
    rm -rf "$ctx"
}
trap cleanup EXIT
mkdir "$ctx/bin"
bins=()
while read -r bin; do
    # The node agents only: test tools (kubelet-peer, plugin-bench) stay out.
    case "$(basename "$bin")" in
        vfio-manager | sandbox-validator | sandbox-device-plugin) ;;
        *) continue ;;
    esac
    cp "$bin" "$ctx/bin/"
    bins+=("$(basename "$bin")")
done <"$list"
log "binaries: ${bins[*]}"

# 3. The runtime image.
log "building $image (target runtime-prebuilt)"
previous="$("${bh[@]}" images --quiet --no-trunc "$image" 2>/dev/null | head -n1 || true)"
"${bh[@]}" bud --isolation chroot --quiet \
    -f "$repo_root/Dockerfile" --target runtime-prebuilt \
    --build-arg "VERSION=$version" --build-arg "REVISION=$revision" \
    -t "$image" "$ctx" >/dev/null
current="$("${bh[@]}" images --quiet --no-trunc "$image" | head -n1)"
# A rebuild moves the tag; drop the image it left behind (unless still used).
if [[ -n "$previous" && "$previous" != "$current" ]]; then
    "${bh[@]}" rmi "$previous" >/dev/null 2>&1 || true
fi

# 4. Proof. What the image holds, listed before anything runs in it (running
# adds mount points such as /proc and /etc/hosts to the working container).
ctr="$("${bh[@]}" from --pull-never "$image")"
mnt="$("${bh[@]}" mount "$ctr")"
printf 'image %s contents:\n' "$image"
(cd "$mnt" && find . -mindepth 1 | sort | sed 's/^\./  /')
rootfs_bytes="$(du -sb "$mnt" | cut -f1)"
"${bh[@]}" umount "$ctr" >/dev/null
mnt=""

# Every binary runs inside the image (no shell there: direct exec).
for b in "${bins[@]}"; do
    printf '$ %s --version\n' "$b"
    "${bh[@]}" run --isolation chroot "$ctr" -- "$b" --version
done
printf '$ vfio-manager --help\n'
"${bh[@]}" run --isolation chroot "$ctr" -- vfio-manager --help

printf '\nimage config: user=%s cmd=%s\n' \
    "$("${bh[@]}" inspect --type image --format '{{.OCIv1.Config.User}}' "$image")" \
    "$("${bh[@]}" inspect --type image --format '{{.OCIv1.Config.Cmd}}' "$image")"
printf 'labels: %s\n' \
    "$("${bh[@]}" inspect --type image --format '{{.OCIv1.Config.Labels}}' "$image")"

size="$("${bh[@]}" images --format '{{.Size}}' "$image" | head -n1)"
printf 'image size: %s (root filesystem %s bytes)\n' "$size" "$rootfs_bytes"

if [[ -n "$archive" ]]; then
    mkdir -p "$(dirname "$archive")"
    rm -f "$archive"
    "${bh[@]}" push --quiet "$image" "docker-archive:$archive:$image"
    printf 'archive: %s (%s bytes)\n' "$archive" "$(stat -c %s "$archive")"
fi
