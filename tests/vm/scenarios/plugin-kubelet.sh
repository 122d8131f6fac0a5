# sandbox-device-plugin on the real kernel: vfio-manager binds the stand-ins, the
# plugin registers with the kubelet-like peer, Allocate hands out real /dev/vfio
# nodes that QEMU, in a container given exactly that answer, takes (and cannot
# start without the group node), and health follows a hand-made unbind within
# one second.
# vm: needs=qemu
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
D=/var/lib/kubelet/device-plugins
mkdir -p "$D"

step "vfio-manager bind --all" -- vfio-manager bind --all
kubelet-peer --dir "$D" serve >/tmp/regs.log 2>&1 &
peer=$!
sandbox-device-plugin >/tmp/plugin.log 2>&1 &
plugin=$!
wait_for "plugin registers example.com/NIC_PT" 10 -- grep -q "registered example.com/NIC_PT" /tmp/regs.log
run_logged cat /tmp/regs.log
EP=$(awk '$2 == "example.com/NIC_PT" { e = $3 } END { print e }' /tmp/regs.log)
expect_contains "registered as v1beta1" /tmp/regs.log "v1beta1"
step "endpoint is a bare name of a socket in $D" -- test -S "$D/$EP"

note "the first ListAndWatch message"
kubelet-peer --dir "$D" list --endpoint "$EP" >/tmp/list.out 2>&1
run_logged cat /tmp/list.out
for bdf in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
    expect_contains "$bdf listed Healthy, no NUMA topology" /tmp/list.out "$bdf Healthy numa=none"
done
expect_eq "exactly three devices" "$(wc -l </tmp/list.out)" 3

note "Allocate"
kubelet-peer --dir "$D" allocate --endpoint "$EP" "$SOLO_NIC" "$CARD_FN1" >/tmp/alloc.out 2>&1
run_logged cat /tmp/alloc.out
expect_contains "KubeVirt env, BDFs in request order" /tmp/alloc.out \
    "env PCI_RESOURCE_EXAMPLE_COM_NIC_PT=$SOLO_NIC,$CARD_FN1"
solo_group=$(group_of "$SOLO_NIC")
expect_contains "/dev/vfio/vfio handed out" /tmp/alloc.out "device /dev/vfio/vfio /dev/vfio/vfio mrw"
expect_contains "SOLO_NIC's group node handed out" /tmp/alloc.out "device /dev/vfio/$solo_group /dev/vfio/$solo_group mrw"
expect_contains "the card's group node handed out" /tmp/alloc.out "device /dev/vfio/$CARD_GROUP /dev/vfio/$CARD_GROUP mrw"
for node in $(awk '$1 == "device" { print $2 }' /tmp/alloc.out); do
    step "$node exists as a char device in the guest" -- test -c "$node"
done
expect_fail "Allocate of an unknown ID is refused" 2 -- \
    kubelet-peer --dir "$D" allocate --endpoint "$EP" 0000:09:00.0
expect_contains "refusal names the ID" "$TB_OUT" "unknown device IDs: 0000:09:00.0"

note "a VM takes what Allocate gave: QEMU in a container with exactly those nodes and variables"
step "QEMU realizes both devices" -- kubelet-peer vmm --allocate /tmp/alloc.out
cp "$TB_OUT" /tmp/vmm.out
run_logged cat /tmp/vmm.out
expect_contains "SOLO_NIC realized with the host's ids, BAR 0 mapped" /tmp/vmm.out "realized $SOLO_NIC 8086:10d3 (legacy) BAR0@"
expect_contains "CARD_FN1 realized with the host's ids" /tmp/vmm.out "realized $CARD_FN1 8086:10d3 (legacy)"
expect_fail "without the card's group node QEMU cannot start" 1 -- \
    kubelet-peer vmm --allocate /tmp/alloc.out --without-node "/dev/vfio/$CARD_GROUP"
cp "$TB_OUT" /tmp/vmm-nonode.out
run_logged cat /tmp/vmm-nonode.out
expect_contains "QEMU names the node it could not open" /tmp/vmm-nonode.out "Could not open '/dev/vfio/$CARD_GROUP'"

note "health follows the kernel"
step "unbinding SOLO_NIC by hand: Unhealthy within 1 s" -- kubelet-peer --dir "$D" watch --endpoint "$EP" \
    --after "echo $SOLO_NIC > /sys/bus/pci/devices/$SOLO_NIC/driver/unbind" \
    --expect "$SOLO_NIC=Unhealthy" --within-ms 1000
run_logged cat "$TB_OUT"
step "binding it back: Healthy within 1 s" -- kubelet-peer --dir "$D" watch --endpoint "$EP" \
    --after "echo $SOLO_NIC > /sys/bus/pci/drivers_probe" \
    --expect "$SOLO_NIC=Healthy" --within-ms 1000
run_logged cat "$TB_OUT"
# Unbinding one function of the card leaves /dev/vfio/<group> in place: only the
# kernel's uevent can tell.
step "unbinding CARD_FN1 (group node stays): Unhealthy within 1 s" -- kubelet-peer --dir "$D" watch --endpoint "$EP" \
    --after "echo $CARD_FN1 > /sys/bus/pci/devices/$CARD_FN1/driver/unbind" \
    --expect "$CARD_FN1=Unhealthy" --within-ms 1000
run_logged cat "$TB_OUT"
step "/dev/vfio/$CARD_GROUP still there" -- test -c "/dev/vfio/$CARD_GROUP"

note "SIGTERM"
kill -TERM "$plugin"
wait "$plugin"
expect_eq "plugin exits 0 on SIGTERM" "$?" 0
step "plugin removed its socket" -- sh -c "! test -e '$D/$EP'"
run_logged tail -n 20 /tmp/plugin.log

note "time to a VM: the node labelled (vfio-manager run starts, as its DaemonSet pod would) to QEMU realizing the device"
step "vfio-manager unbind --all" -- vfio-manager unbind --all
expect_driver "SOLO_NIC back on e1000e" "$SOLO_NIC" e1000e
t0=$(_tb_now_ms)
vfio-manager run --resync-interval 1h >/tmp/run.log 2>&1 &
manager=$!
wait_for "vfio-manager run writes its ready file" 60 -- test -e /run/vfio-manager/ready
t1=$(_tb_now_ms)
regs_before=$(grep -c 'registered example.com/NIC_PT' /tmp/regs.log)
sandbox-device-plugin >/tmp/plugin2.log 2>&1 &
plugin=$!
wait_for "the plugin registers again" 20 -- sh -c "test \$(grep -c 'registered example.com/NIC_PT' /tmp/regs.log) -gt $regs_before"
t2=$(_tb_now_ms)
EP=$(awk '$2 == "example.com/NIC_PT" { e = $3 } END { print e }' /tmp/regs.log)
step "Allocate SOLO_NIC" -- kubelet-peer --dir "$D" allocate --endpoint "$EP" "$SOLO_NIC"
cp "$TB_OUT" /tmp/alloc2.out
step "QEMU realizes SOLO_NIC" -- kubelet-peer vmm --allocate /tmp/alloc2.out
t3=$(_tb_now_ms)
cp "$TB_OUT" /tmp/vmm2.out
run_logged cat /tmp/vmm2.out
expect_contains "SOLO_NIC realized" /tmp/vmm2.out "realized $SOLO_NIC 8086:10d3 (legacy) BAR0@"
realize_ms=$(sed -n 's/.* realized [0-9]* device(s) in \([0-9]*\) ms.*/\1/p' /tmp/vmm2.out)
note "time to a VM: path=vfio-manager label_to_vm_ms=$((t3 - t0)) manager_ready_ms=$((t1 - t0)) plugin_registered_ms=$((t2 - t1)) allocate_and_qemu_ms=$((t3 - t2)) qemu_realize_ms=${realize_ms:-0}"
kill -TERM "$plugin" "$manager"
wait "$plugin" "$manager"
kill "$peer" 2>/dev/null
