# Demo, run inside the test-bed VM: the node lifecycle on a real kernel with an
# emulated IOMMU. Intel 82574L NICs (8086:10d3) stand in for NPUs. Steps are
# checked too, so a broken demo says so (the test suite boots it as well).
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/etc/vfio-sandbox.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
D=/var/lib/kubelet/device-plugins
# node_events FILE: type, reason and note of every Event the stand-in API server
# holds, shown and kept in FILE.
node_events() {
    echo "+ fake-apiserver request GET /apis/events.k8s.io/v1/namespaces/default/events"
    fake-apiserver request GET /apis/events.k8s.io/v1/namespaces/default/events |
        grep -o '"note":"[^"]*"\|"reason":"[^"]*"\|"type":"[^"]*"' | sed 's/^/  /' >"$1"
    cat "$1"
}
# still_running PID: alive and not a zombie waiting to be reaped.
still_running() {
    _st=$(awk '/^State:/ { print $2 }' "/proc/$1/status" 2>/dev/null)
    [ -n "$_st" ] && [ "$_st" != Z ]
}
mkdir -p "$D"

note "the resource list"
run_logged cat "$VFIO_SANDBOX_CONFIG"
note "1. container mode: devices on their native driver; the validator says why the node is not ready"
run_logged vfio-manager status
run_logged sandbox-validator

note "2. the node is labelled for VM passthrough: vfio-manager run lands (the DaemonSet main)"
# The cluster, as far as vfio-manager sees it: a stand-in API server on the
# guest's loopback serving this Node (labelled vm-passthrough), the DaemonSet of
# the standalone overlay (it selects on that one label) and the pod it runs.
ifconfig lo 127.0.0.1 up 2>/dev/null || ip link set lo up
LABEL=rebellions.ai/npu.workload.config
fake-apiserver serve --listen 127.0.0.1:6443 --kubeconfig /tmp/kubeconfig \
    --node demo-node --label "$LABEL=vm-passthrough" \
    --daemonset vfio-sandbox/vfio-manager --selector "$LABEL=vm-passthrough" \
    --pod vfio-sandbox/vfio-manager-pod1 >/tmp/apiserver.log 2>&1 &
wait_for "the stand-in API server serves" 10 -- test -s /tmp/kubeconfig
# What the DaemonSet's downward API and service account give the pod.
export KUBECONFIG=/tmp/kubeconfig NODE_NAME=demo-node POD_NAMESPACE=vfio-sandbox
POD_NAME=vfio-manager-pod1 vfio-manager run >/tmp/manager.log 2>&1 &
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

note "7. a rollout (new image, edited resource list): the pod is replaced, the node keeps its label"
# A watcher on the plugin's ListAndWatch stream: it succeeds only if the card
# turns Unhealthy, which is what a restore-and-rebind would show kubelet.
kubelet-peer --dir "$D" watch --endpoint "$EP" --after true \
    --expect "$CARD_FN0=Unhealthy" --within-ms 60000 >/tmp/watch.log 2>&1 &
watcher=$!
sleep 1
kill -TERM "$manager"
wait "$manager"
expect_eq "the old vfio-manager exits 0" "$?" 0
run_logged tail -n 2 /tmp/manager.log
expect_contains "it found the node still selected" /tmp/manager.log "the node stays in VM mode"
expect_driver "card stays on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "lone NIC stays on vfio-pci" "$SOLO_NIC" vfio-pci
# The new pod: its object, then its process.
fake-apiserver request POST /api/v1/namespaces/vfio-sandbox/pods \
    '{"apiVersion":"v1","kind":"Pod","metadata":{"name":"vfio-manager-pod2","namespace":"vfio-sandbox","ownerReferences":[{"apiVersion":"apps/v1","kind":"DaemonSet","name":"vfio-manager","uid":"uid-ds-vfio-manager","controller":true}]},"spec":{"nodeName":"demo-node","containers":[{"name":"vfio-manager","image":"localhost/vfio-sandbox:0.1.1"}]}}' >/dev/null
POD_NAME=vfio-manager-pod2 vfio-manager run >/tmp/manager2.log 2>&1 &
manager=$!
wait_for "the new vfio-manager is Ready (its readiness probe)" 30 -- vfio-manager ready
run_logged vfio-manager ready
run_logged cat /tmp/manager2.log
expect_not_contains "the new pod had nothing to bind" /tmp/manager2.log "bound 0000"
sleep 1
step "kubelet never saw the card turn Unhealthy during the rollout" still_running "$watcher"
kill "$watcher" 2>/dev/null
wait "$watcher" 2>/dev/null
note "   what the cluster was told (Node events)"
node_events /tmp/events1
expect_contains "the Node was told its devices were bound" /tmp/events1 '"reason":"DevicesBound"'
expect_contains "... which ones" /tmp/events1 '"note":"bound 3 device(s) to vfio: '
expect_contains "... and that the rollout kept them" /tmp/events1 '"reason":"DevicesKept"'
expect_not_contains "... all as Normal events" /tmp/events1 '"type":"Warning"'

note "8. the label goes back to container: the DaemonSets get SIGTERM, devices go home"
run_logged fake-apiserver request PATCH /api/v1/nodes/demo-node "{\"metadata\":{\"labels\":{\"$LABEL\":\"container\"}}}"
kill -TERM "$plugin"
wait "$plugin"
kill -TERM "$manager"
wait "$manager"
run_logged grep -E 'stopping|VM mode|restored' /tmp/manager2.log
node_events /tmp/events2
expect_contains "the Node was told its devices went home" /tmp/events2 '"reason":"DevicesRestored"'
expect_contains "... which ones" /tmp/events2 '"note":"restored 3 device(s) to their native drivers: '
expect_not_contains "... as a Normal event" /tmp/events2 '"type":"Warning"'
expect_contains "it found the node no longer selected" /tmp/manager2.log "$LABEL=container"
step "the validator's ready file is gone with VM mode" sh -c "! test -e /run/vfio-sandbox/validations/vfio-pci-ready"
run_logged vfio-manager status
expect_driver "card back on e1000e" "$CARD_FN0" e1000e
expect_driver "companion back on e1000e" "$CARD_FN1" e1000e
