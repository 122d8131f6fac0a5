# Shared helpers for the VM test bed scripts (sourced, bash).
# shellcheck shell=bash

vm_log() { printf 'vm: %s\n' "$*" >&2; }
vm_die() { vm_log "error: $*"; exit 2; }

# vm_ensure_packages PKG:COMMAND... -- install the Debian packages whose
# command is missing (one apt-get update, only when something is missing).
vm_ensure_packages() {
    local spec pkg cmd missing=()
    for spec in "$@"; do
        pkg="${spec%%:*}"
        cmd="${spec#*:}"
        if ! command -v "$cmd" >/dev/null 2>&1 && [[ ! -x "$cmd" ]] &&
            [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]]; then
            missing+=("$pkg")
        fi
    done
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null || vm_die "missing ${missing[*]} and no apt-get to install them"
    vm_log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
}

# The packages the bed needs on the host, as package:command pairs.
# shellcheck disable=SC2034  # used by run.sh and initramfs.sh
VM_HOST_PACKAGES=(
    qemu-system-x86:qemu-system-x86_64
    busybox-static:/bin/busybox
    kmod:/sbin/depmod
    cpio:cpio
    xz-utils:xz
)

# What arm64 kernels (--kernel <suite>-arm64) need in addition: the aarch64
# system emulator and readelf (the initramfs asks it for kmod's interpreter).
# The cross toolchain is installed by scripts/build-static.sh.
# shellcheck disable=SC2034  # used by run.sh
VM_HOST_PACKAGES_ARM64=(
    qemu-system-arm:qemu-system-aarch64
    binutils:readelf
)
