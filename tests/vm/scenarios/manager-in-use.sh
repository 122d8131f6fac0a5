# vfio-manager scenario 4: a group held open (as by a running VM) is never unbound.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"

step "bind --all" -- vfio-manager bind --all
note "hold /dev/vfio/$CARD_GROUP open like a VM does"
sh -c "exec 3<>/dev/vfio/$CARD_GROUP; echo holding; sleep 600" >/tmp/holder.log 2>&1 &
holder=$!
wait_for "holder has the group open" 5 -- grep -q holding /tmp/holder.log
start=$(_tb_now_ms)
expect_fail "unbind --all exits 1 while the group is held" 1 -- vfio-manager unbind --all
cp "$TB_OUT" /tmp/unbind1.out
took=$(($(_tb_now_ms) - start))
run_logged cat /tmp/unbind1.out
step "unbind returned promptly (${took} ms)" -- test "$took" -lt 10000
expect_contains "says why it skipped" /tmp/unbind1.out "skipped $CARD_FN0: /dev/vfio/$CARD_GROUP is open"
expect_driver "held CARD_FN0 left on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "held CARD_FN1 left on vfio-pci" "$CARD_FN1" vfio-pci
expect_driver "SOLO_NIC (free group) restored" "$SOLO_NIC" e1000e
expect_contains "held devices keep their record" /run/vfio-manager/state.json "\"$CARD_FN0\""

note "release the group and unbind again"
kill "$holder"
wait "$holder" 2>/dev/null
step "unbind --all" -- vfio-manager unbind --all
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
expect_contains "state file: no device left" /run/vfio-manager/state.json '"devices": {}'
