# vfio-manager scenario 1: binding moves whole IOMMU groups to vfio-pci.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"

note "status before binding"
step "status exits 0" -- vfio-manager status
run_logged vfio-manager status
vfio-manager status --output json >/tmp/status.json
expect_contains "status json: card group not viable yet" /tmp/status.json '"group_viable": false'

note "dry run on the real kernel changes nothing"
vfio-manager bind --all --dry-run >/tmp/dry.out 2>&1
expect_contains "dry run shows the override write" /tmp/dry.out \
    "would write vfio-pci to /sys/bus/pci/devices/$CARD_FN0/driver_override"
expect_contains "dry run shows the probe write" /tmp/dry.out \
    "would write $CARD_FN1 to /sys/bus/pci/drivers_probe"
expect_eq "dry run plans each module load once" "$(grep -c 'would load module vfio from' /tmp/dry.out)" 1
expect_contains "dry run summary says would" /tmp/dry.out "would bind $CARD_FN0 (now on e1000e)"
expect_not_contains "dry run logs nothing as done" /tmp/dry.out "INFO"
expect_driver "dry run left CARD_FN0 on e1000e" "$CARD_FN0" e1000e
expect_fail "dry run loaded no module" 1 -- module_loaded vfio_pci
expect_fail "dry run wrote no state file" 1 -- test -e /run/vfio-manager/state.json

note "bind one function: its group companion moves with it"
step "bind --device CARD_FN0" -- vfio-manager bind --device "$CARD_FN0"
run_logged cat "$TB_OUT"
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "CARD_FN1 (same group) on vfio-pci" "$CARD_FN1" vfio-pci
expect_driver "SOLO_NIC (other group) untouched" "$SOLO_NIC" e1000e
step "/dev/vfio/$CARD_GROUP is a char device" -- test -c "/dev/vfio/$CARD_GROUP"

note "bind --all"
step "bind --all" -- vfio-manager bind --all
cp "$TB_OUT" /tmp/bind-all.out
expect_contains "card reported already bound" /tmp/bind-all.out "already bound $CARD_FN0"
expect_contains "SOLO_NIC reported bound from e1000e" /tmp/bind-all.out "bound $SOLO_NIC (was on e1000e)"
expect_driver "SOLO_NIC on vfio-pci" "$SOLO_NIC" vfio-pci
vfio-manager status --output json >/tmp/status.json
expect_not_contains "status json: every group viable" /tmp/status.json '"group_viable": false'
expect_contains "status json: card group viable" /tmp/status.json '"group_viable": true'
run_logged vfio-manager status
expect_contains "state records CARD_FN1's original driver" /run/vfio-manager/state.json '"original_driver": "e1000e"'
step "bind --all again is a no-op" -- vfio-manager bind --all
expect_not_contains "second bind moved nothing" "$TB_OUT" "(was on"
