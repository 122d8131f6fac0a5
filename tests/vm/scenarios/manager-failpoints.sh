# vfio-manager scenario: kill -9 `run` at each step of binding one device — after its
# record is saved, after the driver_override write, after the unbind, after the
# probe — and, with --unload-module, after the probe of a device whose native module
# is gone. Each time the shipped `unbind --all` must put every device back on e1000e
# with driver_override cleared, reload e1000e, and leave the state file empty.
# Then the node leaves VM mode while `run` runs against the stand-in API server: it
# restores while running, is killed with SIGKILL between two devices of that
# restore, and the pod its restore label brings back finishes the restore and drops
# the label, binding nothing.
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

note "leaving VM mode: SIGKILL mid-restore, and the next pod finishes without a person"
# The stand-in API server holds what a cluster would: the Node with the deploy
# label, the DaemonSet shaped like manifests/base/vfio-manager.yaml (deploy label
# OR restore label, two required node-affinity terms) and its pod on the Node.
NODE=vm-node
NS=vfio-sandbox
DEPLOY=rebellions.ai/npu.deploy.vfio-manager
PENDING=vfio-sandbox.rebellions.ai/vfio-manager.restore-pending
ifconfig lo 127.0.0.1 up 2>/dev/null || ip link set lo up
fake-apiserver serve --listen 127.0.0.1:6443 --kubeconfig /tmp/kubeconfig \
    --node "$NODE" --label "$DEPLOY=true" \
    --daemonset "$NS/vfio-manager" --selector "$DEPLOY=true" --restore-label "$PENDING" \
    --pod "$NS/vfio-manager-a1" >/tmp/apiserver.log 2>&1 &
wait_for "the stand-in API server serves" 10 -- test -s /tmp/kubeconfig
export KUBECONFIG=/tmp/kubeconfig NODE_NAME=$NODE POD_NAMESPACE=$NS POD_NAME=vfio-manager-a1
labelled() { fake-apiserver request GET "/api/v1/nodes/$NODE" | grep -q "\"$PENDING\":\"true\""; }
# count_on DRIVER: how many of the three NICs are on DRIVER ("none": unbound).
count_on() {
    n=0
    for d in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
        [ "$(driver_of "$d")" = "$1" ] && n=$((n + 1))
    done
    echo "$n"
}

# One group after another (--bind-jobs 1), so the kill lands between devices:
# the first device restored passes restore-after-unbind, the second stops there,
# unbound from vfio-pci and not yet probed by e1000e.
FAILPOINTS="restore-after-unbind=1*off->return" \
    vfio-manager-failpoints --bind-jobs 1 run --resync-interval 1s >/tmp/leave1.log 2>&1 &
leave_pid=$!
wait_for "run binds the NICs" 30 -- test -e /run/vfio-manager/ready
wait_for "run labels its Node $PENDING=true" 10 -- labelled
expect_eq "three NICs on vfio-pci" "$(count_on vfio-pci)" 3
step "the deploy label is removed (the node leaves VM mode)" -- \
    fake-apiserver request PATCH "/api/v1/nodes/$NODE" "{\"metadata\":{\"labels\":{\"$DEPLOY\":null}}}"
wait_for "run sees it and restores while running" 20 -- \
    grep -q "the node leaves VM mode; restoring while this pod runs" /tmp/leave1.log
wait_for "the restore stops between two devices" 30 -- \
    grep -q "failpoint restore-after-unbind: paused" /tmp/leave1.log
step "SIGKILL mid-restore" -- kill -9 "$leave_pid"
wait "$leave_pid" 2>/dev/null
run_logged cat /tmp/leave1.log
run_logged cat "$STATE"
expect_eq "one NIC back on e1000e" "$(count_on e1000e)" 1
expect_eq "one NIC left with no driver" "$(count_on none)" 1
expect_eq "one NIC still on vfio-pci" "$(count_on vfio-pci)" 1
restored=$(for d in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do [ "$(driver_of "$d")" = e1000e ] && echo "$d"; done)
expect_not_contains "the restored NIC's record is gone" "$STATE" "\"$restored\""
step "the restore label still stands, so the DaemonSet's second term keeps selecting the node" -- labelled

# The DaemonSet controller recreates the pod (a new name, owned by the DaemonSet).
step "the recreated pod" -- fake-apiserver request POST "/api/v1/namespaces/$NS/pods" \
    "{\"apiVersion\":\"v1\",\"kind\":\"Pod\",\"metadata\":{\"name\":\"vfio-manager-b2\",\"namespace\":\"$NS\",\"ownerReferences\":[{\"apiVersion\":\"apps/v1\",\"kind\":\"DaemonSet\",\"name\":\"vfio-manager\",\"uid\":\"uid-ds-vfio-manager\",\"controller\":true}]},\"spec\":{\"nodeName\":\"$NODE\",\"containers\":[{\"name\":\"vfio-manager\",\"image\":\"localhost/vfio-sandbox:0.1.0\"}]}}"
POD_NAME=vfio-manager-b2 vfio-manager run --resync-interval 1s >/tmp/leave2.log 2>&1 &
leave_pid=$!
wait_for "the new pod finishes the restore and removes the label" 30 -- sh -c "! fake-apiserver request GET /api/v1/nodes/$NODE | grep -q '$PENDING'"
run_logged cat /tmp/leave2.log
expect_contains "it started out of VM mode" /tmp/leave2.log "the node is not in VM mode: finishing the restore, binding nothing"
expect_not_contains "it bound nothing" /tmp/leave2.log "bound bdf"
for d in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
    expect_driver "$d back on e1000e" "$d" e1000e
    expect_contains "$d driver_override cleared" "/sys/bus/pci/devices/$d/driver_override" "(null)"
done
expect_contains "state file empty" "$STATE" '"devices": {}'
step "the pod is still running until the DaemonSet controller stops it" -- kill -0 "$leave_pid"
kill -TERM "$leave_pid"
wait "$leave_pid"
expect_eq "SIGTERM then: exit 0" "$?" 0
run_logged cat /tmp/leave2.log
