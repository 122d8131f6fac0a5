#!/usr/bin/env bash
# Build the multi-arch FROM-scratch runtime image (linux/amd64 and
# linux/arm64) from static binaries built on this host (Dockerfile target
# `runtime-prebuilt`) with buildah, join the two in a manifest list, then
# prove them: list what each image holds, run each binary's --version (a
# hard failure when one does not run or does not print the workspace
# version), print each size.
#
#   scripts/image.sh [--tag IMAGE] [--archive FILE] [--arch LIST]
#                    [--profile release|testbed] [--remove]
#
#   --tag IMAGE     name of the manifest list (env IMAGE; default
#                   localhost/vfio-sandbox:<workspace version>, the name the
#                   manifests use, or ...:<version>-<profile> for another
#                   profile than release); the per-architecture images are
#                   IMAGE-amd64 and IMAGE-arm64
#   --archive FILE  also write the whole list (index and both images) as an
#                   OCI archive, e.g. to load it on a node without a registry
#                   (containerd picks the node's platform from the index):
#                     ctr -n k8s.io images import FILE
#   --arch LIST     architectures, comma-separated (env IMAGE_ARCHS; default
#                   amd64,arm64)
#   --profile P     cargo profile of the binaries (env IMAGE_PROFILE; default
#                   release, what real images ship). `testbed` reuses the
#                   real-kernel test bed's static build (release without LTO,
#                   symbols kept), so CI proves the image without a second
#                   full build per architecture; the image's version label
#                   then says <version>+testbed
#   --remove        remove the images and the list once proven (the archive
#                   stays): nothing is left in the container storage
#
# The binaries come from scripts/build-static.sh, aarch64 cross-compiled with
# Debian's cross gcc. Each architecture is one `buildah bud --platform
# linux/<arch>` over a context with bin/<arch>/; the Dockerfile stage is
# COPY only, so building the arm64 image needs no emulation. A binary of the
# host's architecture runs inside its image (buildah run); a foreign one is
# checked with `file` (static, right machine) and run with QEMU's user-mode
# emulator (Debian's qemu-user, installed without its binfmt registration
# when missing; qemu-user-static does as well) from the image's root
# filesystem.
#
# Needs root (buildah with the vfs storage driver and chroot isolation, which
# work without overlayfs, user namespaces or a daemon); installs Debian's
# buildah when it is missing. Storage driver: env BUILDAH_STORAGE_DRIVER
# (default vfs). Each run replaces the images of the same tags and removes
# what an interrupted run of the same tags left behind (working containers),
# so repeated runs do not fill the storage.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf 'image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

version="$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$repo_root/Cargo.toml")"
[[ -n "$version" ]] || die "no version in [workspace.package] of Cargo.toml"
image="${IMAGE:-}"
archive=""
arch_list="${IMAGE_ARCHS:-amd64,arm64}"
profile="${IMAGE_PROFILE:-release}"
remove=0
while (($#)); do
    case "$1" in
        --tag) image="${2:?--tag needs a value}"; shift 2 ;;
        --tag=*) image="${1#*=}"; shift ;;
        --archive) archive="${2:?--archive needs a value}"; shift 2 ;;
        --archive=*) archive="${1#*=}"; shift ;;
        --arch) arch_list="${2:?--arch needs a value}"; shift 2 ;;
        --arch=*) arch_list="${1#*=}"; shift ;;
        --profile) profile="${2:?--profile needs release or testbed}"; shift 2 ;;
        --profile=*) profile="${1#*=}"; shift ;;
        --remove) remove=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/{/^#/!d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
IFS=, read -r -a archs <<<"$arch_list"
((${#archs[@]})) || die "--arch names no architecture"
for a in "${archs[@]}"; do
    [[ "$a" == amd64 || "$a" == arm64 ]] || die "--arch wants amd64 and/or arm64, got '$a'"
done
# Which build the binaries come from. release: the five shipped programs only (as
# the Dockerfile's builder builds them). testbed: the test bed's build (the
# node binaries, its stand-ins and the failpoints variants), invoked as
# scripts/vm/run.sh does, so cargo finds it up to date instead of building
# again with other feature unification.
case "$profile" in
    release)
        image_version="$version"
        static_packages="vfio-manager sandbox-validator sandbox-device-plugin sandbox-dra-driver sandbox-dra-controller"
        ;;
    testbed)
        image_version="$version+$profile"
        static_packages=""
        ;;
    *) die "--profile wants release or testbed, got '$profile'" ;;
esac
[[ -n "$image" ]] || image="localhost/vfio-sandbox:${image_version/+/-}"
revision="$(git -C "$repo_root" rev-parse HEAD 2>/dev/null || echo unknown)"
host_arch="$(dpkg --print-architecture 2>/dev/null || echo amd64)"

# Debian packages, only when missing, without recommended ones, never
# removing one (scripts/lib/packages.sh).
# shellcheck source=scripts/lib/packages.sh
source "$repo_root/scripts/lib/packages.sh"
apt_install() {
    pkg_ensure image "$@" || die "cannot install what the image build needs (above)"
}
apt_install buildah:buildah file:file
bh=(buildah --storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")

# Debian architecture -> the build-static.sh / QEMU / `file` names.
rust_arch() { case "$1" in amd64) echo x86_64 ;; arm64) echo aarch64 ;; esac; }
file_arch() { case "$1" in amd64) echo x86-64 ;; arm64) echo 'ARM aarch64' ;; esac; }
# QEMU's user-mode emulator for a foreign architecture, installed when missing
# (qemu-user, without the binfmt registration it recommends: it is called
# directly, nothing on the host changes how it runs foreign binaries).
qemu_user() {
    local q
    for q in "qemu-$(rust_arch "$1")-static" "qemu-$(rust_arch "$1")"; do
        command -v "$q" >/dev/null && { echo "$q"; return; }
    done
    apt_install "qemu-user:qemu-$(rust_arch "$1")"
    command -v "qemu-$(rust_arch "$1")" >/dev/null || die "qemu-user has no qemu-$(rust_arch "$1")"
    echo "qemu-$(rust_arch "$1")"
}

work="$(mktemp -d)"
ctx="$work/context"
ctr=""
mnt=""
cleanup() {
    [[ -n "$mnt" ]] && "${bh[@]}" umount "$ctr" >/dev/null 2>&1
    [[ -n "$ctr" ]] && "${bh[@]}" rm "$ctr" >/dev/null 2>&1
    rm -rf "$work"
}
trap cleanup EXIT
# buildah checks every image it commits or copies against the signature
# policy, /etc/containers/policy.json (Debian's golang-github-containers-common;
# a conffile, so gone for good once deleted by hand). These images are built
# FROM scratch and never pulled: without the host's policy, one that accepts
# local images does.
policy=()
if [[ ! -e /etc/containers/policy.json ]]; then
    log "no /etc/containers/policy.json: using a policy that accepts any image (nothing is pulled)"
    printf '{"default": [{"type": "insecureAcceptAnything"}]}\n' >"$work/policy.json"
    policy=(--signature-policy "$work/policy.json")
fi

# 0. What an interrupted run of the same tags left: its working containers
# (the images themselves are replaced below).
while read -r id name; do
    case "$name" in
        "$image"-amd64 | "$image"-arm64)
            log "removing working container $id of $name left by an earlier run"
            "${bh[@]}" rm "$id" >/dev/null
            ;;
    esac
done < <("${bh[@]}" containers --all --noheading --format '{{.ContainerID}} {{.ImageName}}')

# 1. A build context holding bin/<arch>/<binary>, from one static build per
# architecture.
log "binaries of cargo profile $profile; image $image, version label $image_version"
declare -A arch_bins=()
for a in "${archs[@]}"; do
    out_dir="$("$repo_root/scripts/build-static.sh" --arch "$(rust_arch "$a")" \
        --profile "$profile" --packages "$static_packages")"
    list="$out_dir/static-bins.list"
    [[ -s "$list" ]] || die "no binaries listed in $list"
    mkdir -p "$ctx/bin/$a"
    bins=()
    while read -r bin; do
        # The node agents only: test tools (kubelet-peer, plugin-bench) and
        # the failpoints variants stay out.
        case "$(basename "$bin")" in
            vfio-manager | sandbox-validator | sandbox-device-plugin | sandbox-dra-driver | sandbox-dra-controller) ;;
            *) continue ;;
        esac
        cp "$bin" "$ctx/bin/$a/"
        bins+=("$(basename "$bin")")
    done <"$list"
    ((${#bins[@]} == 5)) || die "$a: expected 5 programs, got: ${bins[*]}"
    arch_bins[$a]="${bins[*]}"
    log "$a binaries ($out_dir): ${bins[*]}"
done

# 2. One image per architecture, then the manifest list.
for a in "${archs[@]}"; do
    log "building $image-$a (target runtime-prebuilt, linux/$a)"
    previous="$("${bh[@]}" images --quiet --no-trunc "$image-$a" 2>/dev/null | head -n1 || true)"
    # TARGETARCH and BUILDARCH are also passed explicitly: buildah versions
    # differ in which platform arguments they set on their own.
    "${bh[@]}" bud "${policy[@]}" --isolation chroot --quiet --platform "linux/$a" \
        -f "$repo_root/Dockerfile" --target runtime-prebuilt \
        --build-arg "TARGETARCH=$a" --build-arg "BUILDARCH=$host_arch" \
        --build-arg "VERSION=$image_version" --build-arg "REVISION=$revision" \
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

# ARCH BINARY COMMAND...: run COMMAND --version, print what it says; fail
# unless it ran and named the binary and the workspace version.
check_version() {
    local a="$1" b="$2" out
    shift 2
    out="$("$@" --version 2>&1)" || die "$a/$b --version did not run: $out"
    printf '%s\n' "$out"
    [[ "$out" == *"$b"*"$version"* ]] || die "$a/$b --version does not say $b $version"
}

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
        # Foreign binaries: QEMU's user-mode emulation straight from the root
        # filesystem.
        qemu="$(qemu_user "$a")"
        for b in "${bins[@]}"; do
            printf '$ %s %s --version\n' "$qemu" "$b"
            check_version "$a" "$b" "$qemu" "$mnt/usr/bin/$b"
        done
    fi
    "${bh[@]}" umount "$ctr" >/dev/null
    mnt=""
    if [[ "$a" == "$host_arch" ]]; then
        # Every binary runs inside the image (no shell there: direct exec).
        for b in "${bins[@]}"; do
            printf '$ %s --version\n' "$b"
            check_version "$a" "$b" "${bh[@]}" run --isolation chroot "$ctr" -- "$b"
        done
        # And the image's CMD; the first line of what it prints.
        cmd="$("${bh[@]}" inspect --type image --format '{{.OCIv1.Config.Cmd}}' "$image-$a")"
        [[ "$cmd" == '[vfio-manager --help]' ]] || die "$a: unexpected CMD $cmd"
        printf '$ vfio-manager --help   (the CMD)\n'
        help="$("${bh[@]}" run --isolation chroot "$ctr" -- vfio-manager --help 2>&1)" ||
            die "$a: the image's CMD did not run: $help"
        printf '%s\n' "${help%%$'\n'*}"
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
    printf 'image size linux/%s (profile %s): %s\n' "$a" "$profile" "${sizes[$a]}"
done

if [[ -n "$archive" ]]; then
    mkdir -p "$(dirname "$archive")"
    rm -f "$archive"
    "${bh[@]}" manifest push "${policy[@]}" --quiet --all "$image" "oci-archive:$archive:$image" >/dev/null
    # What a node's runtime reads: index.json names the list, the list each
    # platform's image.
    list_digest="$(tar -xOf "$archive" index.json | grep -o '"digest":"sha256:[0-9a-f]*"' | head -n1 | cut -d: -f3 | tr -d '"')"
    [[ -n "$list_digest" ]] || die "$archive: no manifest list in index.json"
    platforms="$(tar -xOf "$archive" "blobs/sha256/$list_digest" |
        grep -o '"architecture":"[a-z0-9]*"' | cut -d'"' -f4 | sort | sed 's|^|linux/|' | paste -sd' ')"
    [[ "$platforms" == "$(printf 'linux/%s\n' "${archs[@]}" | sort | paste -sd' ')" ]] ||
        die "$archive: the list holds ${platforms:-nothing}, not ${archs[*]}"
    printf 'archive: %s (OCI archive: %s; %s bytes)\n' "$archive" "$platforms" "$(stat -c %s "$archive")"
fi

if ((remove)); then
    # Nothing stays in the storage: the list, then the images (their layers
    # go with them).
    "${bh[@]}" manifest rm "$image" >/dev/null
    for a in "${archs[@]}"; do
        "${bh[@]}" rmi "$image-$a" >/dev/null
    done
    printf 'removed %s and its images from the container storage\n' "$image"
fi
