#!/usr/bin/env bash
# Boots the real-kernel test bed (QEMU, emulated IOMMU, stand-in devices) and runs
# the node lifecycle in it (validator, vfio-manager, device plugin with a kubelet-like
# peer, restore), printing the guest's console.
# Installs what it needs (qemu-system-x86, busybox-static, kmod, cpio, xz-utils,
# libc6-dev, file: only those missing, without recommended packages, never removing
# one) and downloads Debian 12's kernel package.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
# Only the demo's binaries, unoptimised (Cargo profile `demo`): a fresh clone's
# build is then the smaller part of the demo's time. The test suite runs the same
# scenario with the test bed's profile.
VM_PROFILE=demo \
    VM_PACKAGES="vfio-manager sandbox-validator sandbox-device-plugin kubelet-peer fake-apiserver" \
    scripts/vm/run.sh --kernel bookworm scripts/demo/node-lifecycle.sh || status=$?
echo
echo "==== guest console (target/vm-logs/bookworm/node-lifecycle.log) ===="
# Show the demo's own output: from the first note to the end marker.
sed -n '/^---- /,/^TESTBED END/p' target/vm-logs/bookworm/node-lifecycle.log | grep -v '^TESTBED '
echo
echo "the demo took $SECONDS s (build, kernel download and boot included)"
exit "$status"
