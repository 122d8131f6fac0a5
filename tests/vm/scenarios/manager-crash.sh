# vfio-manager scenario 3: kill -9 during run; a restart and unbind still restore,
# including reloading the native module run unloaded.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
READY=/run/vfio-manager/ready

note "run with --unload-module e1000e, then kill -9"
vfio-manager run --unload-module e1000e >/tmp/run1.log 2>&1 &
pid=$!
wait_for "run writes the ready file" 30 -- test -e "$READY"
run_logged cat /tmp/run1.log
expect_fail "e1000e module unloaded" 1 -- module_loaded e1000e
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "CARD_FN1 on vfio-pci" "$CARD_FN1" vfio-pci
expect_driver "SOLO_NIC on vfio-pci" "$SOLO_NIC" vfio-pci
step "kill -9 run" -- kill -9 "$pid"
wait "$pid" 2>/dev/null
expect_contains "state remembers the unloaded module" /run/vfio-manager/state.json '"e1000e"'

note "restart run: removes the stale ready file, converges without moving anything"
step "kill -9 left a stale ready file" -- test -e "$READY"
vfio-manager run >/tmp/run2.log 2>&1 &
pid=$!
wait_for "restarted run is ready" 30 -- grep -q "wrote ready file" /tmp/run2.log
step "ready file present" -- test -e "$READY"
expect_not_contains "restart moved nothing" /tmp/run2.log "bound bdf"
expect_driver "CARD_FN0 still on vfio-pci" "$CARD_FN0" vfio-pci
expect_fail "unbind while run is active is refused" 1 -- vfio-manager unbind --all
expect_contains "refusal names the running vfio-manager" "$TB_OUT" "vfio-manager (pid $pid, since"
expect_contains "refusal names the node's owner lock" "$TB_OUT" "(lock /run/vfio-sandbox/owner/owner.lock)"
expect_driver "refused unbind touched nothing" "$CARD_FN0" vfio-pci
step "kill -9 the restarted run" -- kill -9 "$pid"
wait "$pid" 2>/dev/null
run_logged cat /tmp/run2.log

note "unbind --all after the crash"
step "unbind --all" -- vfio-manager unbind --all
run_logged cat "$TB_OUT"
step "e1000e module reloaded" -- module_loaded e1000e
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
expect_driver "SOLO_NIC back on e1000e" "$SOLO_NIC" e1000e
expect_contains "state file: no device left" /run/vfio-manager/state.json '"devices": {}'
expect_contains "state file: no module left to reload" /run/vfio-manager/state.json '"unloaded_modules": []'

note "SIGTERM restores by itself"
rm -f "$READY"
vfio-manager run >/tmp/run3.log 2>&1 &
pid=$!
wait_for "run is ready again" 30 -- test -e "$READY"
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
kill -TERM "$pid"
wait "$pid"
expect_eq "run exits 0 after SIGTERM" "$?" 0
run_logged cat /tmp/run3.log
expect_driver "CARD_FN0 restored by SIGTERM" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 restored by SIGTERM" "$CARD_FN1" e1000e
expect_fail "ready file removed on exit" 1 -- test -e "$READY"
