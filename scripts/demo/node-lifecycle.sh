# Demo, run inside the test-bed VM: the node lifecycle on a real kernel with an
# emulated IOMMU. Intel 82574L NICs (8086:10d3) stand in for NPUs. Steps are
# checked too, so a broken demo says so (the test suite boots it as well).
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/etc/vfio-sandbox.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
D=/var/lib/kubelet/device-plugins
mkdir -p "$D"

note "the resource list"
run_logged cat "$VFIO_SANDBOX_CONFIG"
note "1. container mode: devices on their native driver; the validator says why the node is not ready"
run_logged vfio-manager status
run_logged sandbox-validator

note "2. the node is labelled for VM passthrough: vfio-manager run lands (the DaemonSet main)"
vfio-manager run >/tmp/manager.log 2>&1 &
manager=$!
wait_for "vfio-manager wrote its ready file" 30 -- test -e /run/vfio-manager/ready
run_logged cat /tmp/manager.log
run_logged vfio-manager status
run_logged ls -l /dev/vfio

note "3. the device plugin's init container: sandbox-validator --wait"
run_logged sandbox-validator --wait --timeout 30s --interval 1s
expect_eq "validator passes" "$?" 0

note "4. sandbox-device-plugin registers with kubelet (here a kubelet-like peer)"
kubelet-peer --dir "$D" serve >/tmp/regs.log 2>&1 &
sandbox-device-plugin >/tmp/plugin.log 2>&1 &
plugin=$!
wait_for "registered" 10 -- grep -q "registered example.com/NIC_PT" /tmp/regs.log
run_logged cat /tmp/regs.log
EP=$(awk '$2 == "example.com/NIC_PT" { e = $3 } END { print e }' /tmp/regs.log)
run_logged kubelet-peer --dir "$D" list --endpoint "$EP"

note "5. a VM asks for two devices: what KubeVirt's virt-launcher receives"
run_logged kubelet-peer --dir "$D" allocate --endpoint "$EP" "$SOLO_NIC" "$CARD_FN0"

note "6. health follows the kernel: a device unbound by hand turns Unhealthy"
run_logged kubelet-peer --dir "$D" watch --endpoint "$EP" \
    --after "echo $SOLO_NIC > /sys/bus/pci/devices/$SOLO_NIC/driver/unbind" \
    --expect "$SOLO_NIC=Unhealthy" --within-ms 1000
expect_eq "Unhealthy within 1 s" "$?" 0

note "7. the label goes back to container: the DaemonSets get SIGTERM, devices go home"
kill -TERM "$plugin"
wait "$plugin"
kill -TERM "$manager"
wait "$manager"
run_logged tail -n 6 /tmp/manager.log
run_logged vfio-manager status
expect_driver "card back on e1000e" "$CARD_FN0" e1000e
expect_driver "companion back on e1000e" "$CARD_FN1" e1000e
