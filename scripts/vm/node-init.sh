#!/bin/sh
# /init of the test bed's Kubernetes node (busybox ash; scripts/vm/node.sh).
#
# Brings up a node as a distribution would, on the bed's real kernel: the
# pseudo file systems and cgroup2, the stand-ins' native drivers (never vfio:
# that is vfio-manager's to load), the data disk (/dev/vda: kubelet,
# containerd, the images), the network of QEMU's user mode (10.0.2.15; the
# host's loopback is 10.0.2.2), containerd with the images imported, and
# kubelet and kube-proxy (nftables) with the configuration and credentials
# the harness put in /node-config/. A shell for the harness listens on TCP 2323 (QEMU forwards a
# host port to it): the harness reads sysfs and the pods' logs through it and
# kills processes with it, as an operator would with ssh.
#
# Console lines "NODE <event> uptime=<s>" time the boot; "NODE FAIL <why>"
# means the node cannot come up (the harness stops on it).
PATH=/data/bin:/sbin:/usr/sbin:/bin:/usr/bin
export PATH
umask 022

# runc's pivot_root(2) cannot leave the initramfs (rootfs cannot be pivoted
# away): copy it into a tmpfs and switch_root there first.
if [ ! -e /.in-tmpfs ]; then
    mkdir -p /newroot
    mount -t tmpfs -o mode=0755 tmpfs /newroot
    for f in /* /.[!.]*; do
        [ -e "$f" ] || continue
        [ "$f" = /newroot ] || cp -a "$f" /newroot/
    done
    touch /newroot/.in-tmpfs
    exec switch_root /newroot /init
fi

up() { cut -d' ' -f1 /proc/uptime; }
event() { echo "NODE $1 uptime=$(up)"; }
fail() {
    echo "NODE FAIL $*"
    dmesg | tail -n 30
    exec sleep 2147483647
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p /sys/fs/cgroup
mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup || fail "mount cgroup2"
dmesg -n 3
[ -r /node-config/node.env ] || fail "/node-config/node.env missing (the harness's archive)"
# shellcheck disable=SC1091
. /node-config/node.env
hostname "$NODE_NAME"
event init

for m in virtio_blk virtio_net ext4 bridge veth overlay e1000e nvme virtio_pci snd_hda_intel \
    nf_tables nft_ct nft_numgen nft_fib_inet nft_masq nft_nat nft_chain_nat nft_reject_inet nft_reject_ipv4 nft_reject_ipv6 nft_objref nf_conntrack_netlink; do
    out=$(/sbin/modprobe "$m" 2>&1) || fail "modprobe $m: $out"
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
mkdir -p /data
mount -t ext4 -o noatime /dev/vda /data || fail "mount /dev/vda"
event modules

# The node's interface is the virtio one (the e1000e stand-ins have theirs).
nic=""
for n in /sys/class/net/*; do
    [ "$(basename "$(readlink "$n/device/driver" 2>/dev/null)")" = virtio_net ] && nic=$(basename "$n")
done
[ -n "$nic" ] || fail "no virtio network interface"
ip link set lo up
ip link set "$nic" up
ip addr add 10.0.2.15/24 dev "$nic"
ip route add default via 10.0.2.2
echo 'nameserver 10.0.2.3' >/etc/resolv.conf

# Every controller for the subtree: kubelet's cgroupfs driver makes /kubepods.
for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
    echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
done

( while :; do nc -ll -p 2323 -e /bin/sh; sleep 1; done ) </dev/null >/dev/null 2>&1 &

# kubelet's and containerd's state on the disk (cadvisor wants a block device).
mkdir -p /data/state/kubelet /data/state/pods /data/state/containerd /var/lib/kubelet /var/log/pods \
    /etc/cni/net.d /var/run/cdi
mount --bind /data/state/kubelet /var/lib/kubelet
mount --bind /data/state/pods /var/log/pods
cp /node-config/10-pods.conflist /etc/cni/net.d/
echo 1 >/proc/sys/net/ipv4/ip_forward
event network

containerd --config=/node-config/containerd.toml >/data/state/containerd.log 2>&1 &
i=0
until ctr --address=/run/containerd/containerd.sock version >/dev/null 2>&1; do
    i=$((i + 1))
    [ $i -lt 600 ] || fail "containerd did not answer in 120 s: $(tail -n 5 /data/state/containerd.log)"
    sleep 0.2
done
for img in /data/images/*.tar; do
    out=$(ctr --address=/run/containerd/containerd.sock -n k8s.io images import --local \
        --snapshotter overlayfs "$img" 2>&1) || fail "importing $img: $out"
done
event containerd

kubelet --config=/node-config/kubelet.yaml --kubeconfig=/node-config/kubelet.kubeconfig \
    --hostname-override="$NODE_NAME" --node-ip=10.0.2.15 --v=2 \
    >/data/state/kubelet.log 2>&1 &
event kubelet
kube-proxy --config=/node-config/kube-proxy.yaml --hostname-override="$NODE_NAME" --v=2 \
    >/data/state/kube-proxy.log 2>&1 &
event kube-proxy
exec sleep 2147483647
