# vfio-manager scenario: kill -9 `run` at each step of binding one device — after its
# record is saved, after the driver_override write, after the unbind, after the
# probe — and, with --unload-module, after the probe of a device whose native module
# is gone. Each time the shipped `unbind --all` must put every device back on e1000e
# with driver_override cleared, reload e1000e, and leave the state file empty.
# Then the node leaves VM mode while `run` runs against the stand-in API server: it
# restores while running and is killed with SIGKILL at each step of that restore
# in turn (first, second and third device); each time the pod its restore label
# brings back finishes the restore and drops the label, binding nothing.
# `vfio-manager-failpoints` is vfio-manager built with the `failpoints` feature: with
# FAILPOINTS=<step>=return it prints "failpoint <step>: paused" and sleeps there.
# vm: needs=vfio-manager,vfio-manager-failpoints,fake-apiserver
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

# ---- leaving VM mode -------------------------------------------------------
# The stand-in API server holds what a cluster would: the Node with the deploy
# label, the DaemonSet shaped like the chart's vfio-manager (deploy label
# OR restore label, two required node-affinity terms) and its pods on the Node.
NODE=vm-node
NS=vfio-sandbox
DEPLOY=rebellions.ai/npu.deploy.vfio-manager
PENDING=vfio-sandbox.rebellions.ai/vfio-manager.restore-pending
ifconfig lo 127.0.0.1 up 2>/dev/null || ip link set lo up
fake-apiserver serve --listen 127.0.0.1:6443 --kubeconfig /tmp/kubeconfig \
    --node "$NODE" --label "$DEPLOY=true" \
    --daemonset "$NS/vfio-manager" --selector "$DEPLOY=true" --restore-label "$PENDING" \
    >/tmp/apiserver.log 2>&1 &
wait_for "the stand-in API server serves" 10 -- test -s /tmp/kubeconfig
export KUBECONFIG=/tmp/kubeconfig NODE_NAME=$NODE POD_NAMESPACE=$NS
labelled() { fake-apiserver request GET "/api/v1/nodes/$NODE" | grep -q "\"$PENDING\":\"true\""; }
unlabelled() { ! fake-apiserver request GET "/api/v1/nodes/$NODE" | grep -q "\"$PENDING\""; }
deploy_label() { fake-apiserver request PATCH "/api/v1/nodes/$NODE" "{\"metadata\":{\"labels\":{\"$DEPLOY\":$1}}}"; }
# new_pod NAME: the DaemonSet controller's pod on the Node.
new_pod() {
    fake-apiserver request POST "/api/v1/namespaces/$NS/pods" \
        "{\"apiVersion\":\"v1\",\"kind\":\"Pod\",\"metadata\":{\"name\":\"$1\",\"namespace\":\"$NS\",\"ownerReferences\":[{\"apiVersion\":\"apps/v1\",\"kind\":\"DaemonSet\",\"name\":\"vfio-manager\",\"uid\":\"uid-ds-vfio-manager\",\"controller\":true}]},\"spec\":{\"nodeName\":\"$NODE\",\"containers\":[{\"name\":\"vfio-manager\",\"image\":\"localhost/vfio-sandbox:0.1.0\"}]}}"
}
# count_on DRIVER: how many of the three NICs are on DRIVER ("none": unbound).
count_on() {
    n=0
    for d in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
        [ "$(driver_of "$d")" = "$1" ] && n=$((n + 1))
    done
    echo "$n"
}

# leave_kill_at FAILPOINT BACK UNBOUND: the node in VM mode, then out of it; run,
# restoring while it runs, is killed at FAILPOINT (BACK NICs then on e1000e,
# UNBOUND on no driver); a recreated pod finishes. One group after another
# (--bind-jobs 1), so the failpoint's count picks the device.
leaves=0
leave_kill_at() {
    leaves=$((leaves + 1))
    fp=$1
    note "leaving VM mode: SIGKILL at $fp, and the next pod finishes without a person"
    step "the node is in VM mode" -- deploy_label '"true"'
    new_pod "vfio-manager-a$leaves" >/dev/null
    FAILPOINTS="$fp" POD_NAME="vfio-manager-a$leaves" \
        vfio-manager-failpoints --bind-jobs 1 run --resync-interval 1s >"/tmp/leave-a$leaves.log" 2>&1 &
    leave_pid=$!
    wait_for "run binds the NICs" 30 -- test -e /run/vfio-manager/ready
    wait_for "run labels its Node $PENDING=true" 10 -- labelled
    expect_eq "three NICs on vfio-pci" "$(count_on vfio-pci)" 3
    step "the deploy label is removed (the node leaves VM mode)" -- deploy_label null
    wait_for "run sees it and restores while running" 20 -- \
        grep -q "the node leaves VM mode; restoring while this pod runs" "/tmp/leave-a$leaves.log"
    wait_for "the restore reaches $fp" 30 -- \
        grep -q "failpoint ${fp%%=*}: paused" "/tmp/leave-a$leaves.log"
    step "SIGKILL mid-restore" -- kill -9 "$leave_pid"
    wait "$leave_pid" 2>/dev/null
    run_logged cat "/tmp/leave-a$leaves.log"
    run_logged cat "$STATE"
    expect_eq "NICs back on e1000e at the kill" "$(count_on e1000e)" "$2"
    expect_eq "NICs with no driver at the kill" "$(count_on none)" "$3"
    expect_ne "a record is left" "$(grep -c '"original_driver"' "$STATE")" 0
    step "the restore label still stands, so the DaemonSet's second term still selects the node" -- labelled

    new_pod "vfio-manager-b$leaves" >/dev/null
    POD_NAME="vfio-manager-b$leaves" vfio-manager run --resync-interval 1s >"/tmp/leave-b$leaves.log" 2>&1 &
    leave_pid=$!
    wait_for "the recreated pod finishes the restore and removes the label" 30 -- unlabelled
    run_logged cat "/tmp/leave-b$leaves.log"
    expect_contains "it started out of VM mode" "/tmp/leave-b$leaves.log" "the node is not in VM mode: finishing the restore, binding nothing"
    expect_not_contains "it bound nothing" "/tmp/leave-b$leaves.log" "bound bdf"
    for d in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
        expect_driver "$d back on e1000e" "$d" e1000e
        expect_contains "$d driver_override cleared" "/sys/bus/pci/devices/$d/driver_override" "(null)"
    done
    expect_contains "state file empty" "$STATE" '"devices": {}'
    step "the pod runs until the DaemonSet controller stops it" -- kill -0 "$leave_pid"
    kill -TERM "$leave_pid"
    wait "$leave_pid"
    expect_eq "SIGTERM then: exit 0" "$?" 0
}

# The first device with its override cleared; the second unbound from vfio-pci,
# not yet probed by e1000e; the third probed, its record not yet dropped.
leave_kill_at "restore-after-override=return" 0 0
leave_kill_at "restore-after-unbind=1*off->return" 1 1
leave_kill_at "restore-after-probe=2*off->return" 3 0
