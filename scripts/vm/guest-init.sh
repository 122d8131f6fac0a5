#!/bin/sh
# /init of the VM test bed guest (busybox ash).
#
# Mounts the pseudo file systems, loads only the native drivers of the
# stand-in devices (e1000e, nvme; never vfio), waits until every stand-in
# device is bound to its native driver, exports the device map, runs
# /scenario.sh with /lib/testbed.sh sourced, prints the end marker and powers
# the VM off. Every failure prints a TESTBED line so the host never has to
# wait for its timeout to know that something went wrong.
#
# /testbed.env (from the per-scenario archive) provides SCENARIO, the device
# BDFs (CARD_FN0, CARD_FN1, SOLO_NIC, NVME_PF, NVME_VF0, NVME_VF1; VIRTIO_NIC
# on the iommufd kernel only), TESTBED_KERNEL (the --kernel name),
# TESTBED_IOMMU (1 or 0) and TESTBED_GUEST_TIMEOUT (seconds).

PATH=/sbin:/usr/sbin:/bin:/usr/bin
export PATH
umask 022

SCENARIO=unknown

uptime_s() { cut -d' ' -f1 /proc/uptime 2>/dev/null || echo 0; }

poweroff_now() {
    sync
    poweroff -f
    # Not reached unless poweroff failed; panic=-1 and -no-reboot end QEMU.
    echo o >/proc/sysrq-trigger 2>/dev/null
    exit 1
}

# Report a failure of the bed itself (not of a scenario step) and stop.
abort() {
    echo "TESTBED STEP FAIL $SCENARIO: testbed init: $*"
    echo "TESTBED ABORT $SCENARIO: $*"
    echo "---- kernel log (tail) ----"
    dmesg 2>/dev/null | tail -n 40
    poweroff_now
}

mount -t proc proc /proc || abort "mount /proc failed"
mount -t sysfs sysfs /sys || abort "mount /sys failed"
mount -t devtmpfs devtmpfs /dev || abort "mount /dev failed"
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts 2>/dev/null
mount -t tmpfs -o mode=0755 tmpfs /run || abort "mount /run failed"
mount -t tmpfs -o mode=1777 tmpfs /tmp || abort "mount /tmp failed"
[ -d /sys/kernel/debug ] && mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
hostname testbed 2>/dev/null

# Keep the console for TESTBED lines: only emergencies, alerts and critical
# messages interleave with scenario output; the rest of the kernel log of the
# scenario is printed after it.
dmesg -n 3 2>/dev/null

[ -r /testbed.env ] || abort "/testbed.env missing (per-scenario archive not loaded?)"
# shellcheck disable=SC1091
. /testbed.env
[ -r /scenario.sh ] || abort "/scenario.sh missing"
export SCENARIO CARD_FN0 CARD_FN1 SOLO_NIC NVME_PF NVME_VF0 NVME_VF1 GPU_FN0 GPU_AUDIO TESTBED_IOMMU \
    VIRTIO_NIC TESTBED_KERNEL

echo "TESTBED BOOT $SCENARIO: uptime=$(uptime_s) kernel=$(uname -r)"

# Native drivers only; vfio stays unloaded until a scenario loads it.
for m in e1000e nvme virtio_pci snd_hda_intel; do
    # Absolute path: busybox ash runs its own applets before searching PATH.
    out=$(/sbin/modprobe "$m" 2>&1) || abort "modprobe $m failed: $out"
done

bound_to() {
    [ -e "/sys/bus/pci/devices/$1/driver" ] &&
        [ "$(basename "$(readlink "/sys/bus/pci/devices/$1/driver")")" = "$2" ]
}

missing=""
deadline=$(($(cut -d. -f1 /proc/uptime) + 30))
while :; do
    missing=""
    for pair in "$CARD_FN0=e1000e" "$CARD_FN1=e1000e" "$SOLO_NIC=e1000e" "$NVME_PF=nvme" \
        "$GPU_FN0=virtio-pci" "$GPU_AUDIO=snd_hda_intel" ${VIRTIO_NIC:+"$VIRTIO_NIC=virtio-pci"}; do
        bdf=${pair%%=*}
        drv=${pair#*=}
        bound_to "$bdf" "$drv" || missing="$missing $bdf($drv)"
    done
    [ -z "$missing" ] && break
    [ "$(cut -d. -f1 /proc/uptime)" -ge "$deadline" ] && break
    sleep 0.2
done
if [ -n "$missing" ]; then
    echo "---- PCI devices ----"
    for d in /sys/bus/pci/devices/*; do
        drv=none
        [ -e "$d/driver" ] && drv=$(basename "$(readlink "$d/driver")")
        echo "  $(basename "$d") $(cat "$d/vendor"):$(cat "$d/device") driver=$drv"
    done
    abort "devices not bound to their native drivers after 30 s:$missing"
fi

CARD_GROUP=""
if [ "$TESTBED_IOMMU" = 1 ]; then
    [ -e "/sys/bus/pci/devices/$CARD_FN0/iommu_group" ] ||
        abort "IOMMU expected but $CARD_FN0 has no iommu_group"
    CARD_GROUP=$(basename "$(readlink "/sys/bus/pci/devices/$CARD_FN0/iommu_group")")
    GPU_GROUP=$(basename "$(readlink "/sys/bus/pci/devices/$GPU_FN0/iommu_group")")
fi
export CARD_GROUP GPU_GROUP

echo "TESTBED READY $SCENARIO: uptime=$(uptime_s) CARD_FN0=$CARD_FN0 CARD_FN1=$CARD_FN1 CARD_GROUP=${CARD_GROUP:-none} SOLO_NIC=$SOLO_NIC NVME_PF=$NVME_PF"

# Guest-side watchdog, a little ahead of the host's hard timeout, so that a
# hung scenario still leaves a FAIL line and the kernel log in the console log.
(
    sleep "${TESTBED_GUEST_TIMEOUT:-200}"
    echo
    echo "TESTBED STEP FAIL $SCENARIO: watchdog: scenario still running after ${TESTBED_GUEST_TIMEOUT:-200} s"
    echo "---- processes ----"
    ps 2>/dev/null
    echo "---- kernel log (tail) ----"
    dmesg 2>/dev/null | tail -n 60
    echo "TESTBED ABORT $SCENARIO: watchdog timeout"
    poweroff_now
) &
watchdog=$!

klog_start=$(dmesg 2>/dev/null | wc -l)

# The host's no-progress watchdog retries a boot that stalls before this
# line, and never after it.
echo "TESTBED START $SCENARIO: uptime=$(uptime_s)"
echo "==== scenario $SCENARIO ===="
(
    # shellcheck disable=SC1091
    . /lib/testbed.sh
    tb_begin "$SCENARIO"
    # shellcheck disable=SC1091
    . /scenario.sh
    # A failed last step is not a failed script; only "exit N" or a set -e
    # abort makes the status non-zero.
    exit 0
) </dev/null
rc=$?
echo "==== end of scenario $SCENARIO (exit $rc) ===="
if [ "$rc" -ne 0 ]; then
    echo "TESTBED STEP FAIL $SCENARIO: scenario script: exited with status $rc"
fi

kill "$watchdog" 2>/dev/null

echo "---- kernel log during the scenario ----"
dmesg 2>/dev/null | tail -n +"$((klog_start + 1))" | sed 's/^/  /'
echo "---- end of kernel log ----"
echo "TESTBED END $SCENARIO: uptime=$(uptime_s)"
poweroff_now
