# vfio-manager scenario 2: unbind --all restores the native driver everywhere.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"

step "bind --all" -- vfio-manager bind --all
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "CARD_FN1 on vfio-pci" "$CARD_FN1" vfio-pci

note "unbind --all"
step "unbind --all" -- vfio-manager unbind --all
run_logged cat "$TB_OUT"
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
expect_driver "SOLO_NIC back on e1000e" "$SOLO_NIC" e1000e
expect_eq "CARD_FN0 override cleared" "$(cat /sys/bus/pci/devices/$CARD_FN0/driver_override)" "(null)"
expect_eq "CARD_FN1 override cleared" "$(cat /sys/bus/pci/devices/$CARD_FN1/driver_override)" "(null)"
wait_for "/dev/vfio/$CARD_GROUP gone" 5 -- sh -c "! test -e /dev/vfio/$CARD_GROUP"
run_logged cat /run/vfio-manager/state.json
expect_contains "state file: no device left" /run/vfio-manager/state.json '"devices": {}'
step "unbind --all again is a no-op" -- vfio-manager unbind --all
expect_contains "second unbind says nothing recorded" "$TB_OUT" "nothing recorded"
