# vfio-manager scenario: kill -9 `run` at each step of binding one device — after its
# record is saved, after the driver_override write, after the unbind, after the
# probe — and, with --unload-module, after the probe of a device whose native module
# is gone. Each time the shipped `unbind --all` must put every device back on e1000e
# with driver_override cleared, reload e1000e, and leave the state file empty.
# `vfio-manager-failpoints` is vfio-manager built with the `failpoints` feature: with
# FAILPOINTS=<step>=return it prints "failpoint <step>: paused" and sleeps there.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
STATE=/run/vfio-manager/state.json

step "the failpoints build is in the guest" -- command -v vfio-manager-failpoints

# kill_at STEP [RUN FLAGS...]: start run paused at STEP, kill -9 it there, unbind --all.
kill_at() {
    fp_step=$1
    shift
    note "kill -9 run at $fp_step${1:+ ($*)}"
    FAILPOINTS="$fp_step=return" vfio-manager-failpoints run "$@" >"/tmp/$fp_step.log" 2>&1 &
    fp_pid=$!
    wait_for "run stops at $fp_step" 60 -- grep -q "failpoint $fp_step: paused" "/tmp/$fp_step.log"
    step "kill -9 run at $fp_step" -- kill -9 "$fp_pid"
    wait "$fp_pid" 2>/dev/null
    run_logged cat "/tmp/$fp_step.log"
    run_logged cat "$STATE"
    step "unbind --all after the kill at $fp_step" -- vfio-manager unbind --all
    run_logged cat "$TB_OUT"
    step "e1000e loaded after $fp_step" -- module_loaded e1000e
    for d in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
        expect_driver "$d back on e1000e after $fp_step" "$d" e1000e
        expect_contains "$d driver_override cleared after $fp_step" \
            "/sys/bus/pci/devices/$d/driver_override" "(null)"
    done
    expect_contains "state file empty after $fp_step" "$STATE" '"devices": {}'
    expect_contains "no module left to reload after $fp_step" "$STATE" '"unloaded_modules": []'
}

kill_at bind-after-record
kill_at bind-after-override
kill_at bind-after-unbind
kill_at bind-after-probe
kill_at bind-after-probe --unload-module e1000e
