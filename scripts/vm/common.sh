# Shared helpers for the VM test bed scripts (sourced, bash).
# shellcheck shell=bash

vm_log() { printf 'vm: %s\n' "$*" >&2; }
vm_die() { vm_log "error: $*"; exit 2; }

# shellcheck source=scripts/lib/packages.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/packages.sh"

# vm_ensure_packages PKG:COMMAND... -- install the Debian packages whose
# command (or file) is missing, only those, without recommended packages and
# never removing one (scripts/lib/packages.sh).
vm_ensure_packages() {
    pkg_ensure vm "$@" || vm_die "cannot install what the test bed needs (above)"
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
# system emulator, the e1000e option ROM it loads for the stand-in NICs
# (ipxe-qemu: qemu-system-x86 depends on it, qemu-system-arm only recommends
# it) and readelf (the initramfs asks it for kmod's interpreter). The cross
# toolchain is installed by scripts/build-static.sh.
# shellcheck disable=SC2034  # used by run.sh
VM_HOST_PACKAGES_ARM64=(
    qemu-system-arm:qemu-system-aarch64
    ipxe-qemu:/usr/lib/ipxe/qemu/efi-e1000e.rom
    binutils:readelf
)
