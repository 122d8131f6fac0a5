#!/usr/bin/env bash
# Build a Kubernetes node for the real-kernel test bed: Debian 12's kernel
# under QEMU (TCG) with the bed's emulated IOMMU and stand-in devices, running
# kubelet, containerd and runc, with our image in containerd, to join a
# control plane on the host over QEMU's user network (tests/k8s, real-k8s
# --guest-node).
#
# Usage: scripts/vm/node.sh OUT_DIR
#
# Environment (each required):
#   K8S_BINS         the release's binaries (scripts/build-k8s.sh v1.37): kubelet,
#                    kube-proxy
#   CONTAINERD_BINS  containerd, containerd-shim-runc-v2, ctr (build-k8s.sh containerd)
#   IMAGE_ARCHIVE    our image as an OCI archive (scripts/image.sh --archive)
#   NODE_IMAGES      a directory of more image archives to import (*.tar): the
#                    pause and busybox images the harness makes (tests/k8s image.rs)
#   NODE_QEMU_CPIO   the archive of scripts/vm/fetch-qemu.sh: its /opt/qemu goes
#                    to the disk's /vmm/opt/qemu, for the VM pods to mount
#
# Writes to OUT_DIR and prints, as shell assignments:
#   NODE_KERNEL      the kernel to boot (vmlinux through its PVH entry)
#   NODE_INITRD      the initramfs: the bed's base (busybox, kmod, the modules
#                    of the stand-ins, vfio, virtio, ext4) with the node's /init
#                    (scripts/vm/node-init.sh), runc, nft (kube-proxy's
#                    nftables mode) and their libraries, the netfilter
#                    modules kube-proxy's rules use, and the CNI plugins of
#                    the pods' network (Debian's containernetworking-plugins:
#                    bridge, host-local, loopback); the harness appends an
#                    archive of the node's credentials (/node-config/)
#   NODE_DISK        an ext4 image (mkfs.ext4 -d, no mount needed) with
#                    kubelet, kube-proxy, containerd, its shim and ctr, QEMU for
#                    the VM pods, and the images to
#                    import: the pause and busybox images and ours. QEMU opens
#                    it with snapshot=on, so every boot starts from it as built
#   NODE_QEMU_ARGS   a file of QEMU arguments, one per line: the machine, the
#                    bed's IOMMU and stand-in devices, the disk and the network
#                    device (the harness adds -netdev with its port forwards)
#
# Cached by nothing: assembling takes seconds; the inputs are cached where
# they are built.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$here/../.." && pwd)"
# shellcheck source=scripts/vm/common.sh
. "$here/common.sh"
# shellcheck source=scripts/vm/devices.sh
. "$here/devices.sh"

(($# == 1)) || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
out="$1"
for v in K8S_BINS CONTAINERD_BINS IMAGE_ARCHIVE NODE_IMAGES NODE_QEMU_CPIO; do
    [[ -n "${!v:-}" ]] || vm_die "$v is not set (see $0)"
done
for b in kubelet kube-proxy; do
    [[ -x "$K8S_BINS/$b" ]] || vm_die "no $b in $K8S_BINS"
done
[[ -f "$IMAGE_ARCHIVE" ]] || vm_die "no image archive $IMAGE_ARCHIVE"
vm_ensure_packages "${VM_HOST_PACKAGES[@]}" e2fsprogs:mkfs.ext4 runc:runc \
    containernetworking-plugins:/usr/lib/cni/loopback busybox-static:/bin/busybox nftables:/usr/sbin/nft
rm -rf "$out"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# shellcheck disable=SC2034  # assigned by the eval below; only some are used
KERNEL_VERSION="" KERNEL_MODULES="" KERNEL_VMLINUX="" KERNEL_IMAGE="" KERNEL_PVH=""
eval "$(KERNEL_SUITE=bookworm KERNEL_ARCH=amd64 "$repo_root/scripts/fetch-kernel.sh")"
kernel="$KERNEL_IMAGE"
[[ "$KERNEL_PVH" == 1 && -n "$KERNEL_VMLINUX" ]] && kernel="$KERNEL_VMLINUX"

# ---- initramfs: the bed's base and the node's own files ------------------------
# What kube-proxy's nftables rules use (pkg/proxy/nftables/proxier.go: ct,
# numgen, fib, masquerade, dnat, reject, named counters: objref) and its conntrack
# clean-up (netlink).
nft_modules="nf_tables nft_ct nft_numgen nft_fib_inet nft_masq nft_nat nft_chain_nat nft_reject_inet nft_reject_ipv4 nft_reject_ipv6 nft_objref
    nf_conntrack_netlink"
VM_MODULES_EXTRA="virtio_blk virtio_net ext4 crc32c_generic bridge veth overlay $nft_modules" \
    KERNEL_VERSION="$KERNEL_VERSION" KERNEL_MODULES="$KERNEL_MODULES" \
    TMPDIR="$out" "$here/initramfs.sh" "$out/base.cpio"
ov="$out/overlay"
mkdir -p "$ov/usr/sbin" "$ov/usr/lib/cni" "$ov/etc"
cp "$here/node-init.sh" "$ov/init"
chmod 755 "$ov/init"
cp -L "$(command -v runc)" "$ov/usr/sbin/runc"
cp -L /usr/sbin/nft "$ov/usr/sbin/nft"
for p in loopback bridge host-local; do
    cp -L "/usr/lib/cni/$p" "$ov/usr/lib/cni/$p"
done
while read -r lib; do
    [[ -n "$lib" ]] || continue
    mkdir -p "$ov/$(dirname "$lib")"
    cp -L "$lib" "$ov/$lib"
done < <({ ldd "$(command -v runc)"; ldd /usr/sbin/nft; for p in loopback bridge host-local; do ldd "/usr/lib/cni/$p"; done; } 2>/dev/null |
    awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u)
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$ov/etc/passwd"
printf 'root:x:0:\n' >"$ov/etc/group"
printf '127.0.0.1 localhost\n' >"$ov/etc/hosts"
(cd "$ov" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$out/overlay.cpio"
cat "$out/base.cpio" "$out/overlay.cpio" >"$out/initrd"
rm -rf "$ov" "$out/base.cpio" "$out/overlay.cpio"

# ---- the disk --------------------------------------------------------------------
d="$out/disk"
mkdir -p "$d/bin" "$d/images" "$d/state"
cp "$K8S_BINS/kubelet" "$K8S_BINS/kube-proxy" "$d/bin/"
for b in containerd containerd-shim-runc-v2 ctr; do
    cp "$CONTAINERD_BINS/$b" "$d/bin/"
done
cp "$IMAGE_ARCHIVE" "$d/images/vfio-sandbox.tar"
cp "$NODE_IMAGES"/*.tar "$d/images/"
mkdir -p "$d/vmm"
(cd "$d/vmm" && cpio -idm --quiet 'opt/qemu/*' <"$NODE_QEMU_CPIO")
[[ -x "$d/vmm/opt/qemu/bin/qemu-system-x86_64" ]] || vm_die "no opt/qemu/bin/qemu-system-x86_64 in $NODE_QEMU_CPIO"
mkfs.ext4 -q -F -L node-data -d "$d" "$out/disk.img" 2G
rm -rf "$d"

# ---- QEMU ----------------------------------------------------------------------------
# Two vCPUs (NODE_SMP), each a host thread under multi-threaded TCG: kubelet,
# containerd and the pods' processes run side by side (on an idle two-core
# host, the chart's install step took 67 s against 165 s on one vCPU, the
# rollout 82 s against 149).
{
    printf '%s\n' qemu-system-x86_64 -machine q35,accel=tcg -cpu max -m 2G -smp "${NODE_SMP:-2}" \
        -nodefaults -no-user-config -display none -no-reboot
    vm_device_args 1 x86_64 bookworm
    # The node's own devices on the root bus, after the stand-ins' root ports.
    printf '%s\n' \
        -drive "file=$out/disk.img,if=none,id=node_disk,format=raw,snapshot=on,cache=unsafe" \
        -device virtio-blk-pci,drive=node_disk,bus=pcie.0,addr=0x9 \
        -device virtio-net-pci,netdev=node_net,bus=pcie.0,addr=0xa \
        -kernel "$kernel"
} >"$out/qemu.args"

printf 'NODE_KERNEL=%q\n' "$kernel"
printf 'NODE_INITRD=%q\n' "$out/initrd"
printf 'NODE_DISK=%q\n' "$out/disk.img"
printf 'NODE_QEMU_ARGS=%q\n' "$out/qemu.args"
printf 'NODE_KERNEL_VERSION=%q\n' "$KERNEL_VERSION"
