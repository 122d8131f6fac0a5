# sandbox-device-plugin on the real kernel: vfio-manager binds the stand-ins, the
# plugin registers with the kubelet-like peer, Allocate hands out real /dev/vfio
# nodes, and health follows a hand-made unbind within one second.
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
kill "$peer" 2>/dev/null
