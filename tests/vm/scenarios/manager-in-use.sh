# vfio-manager scenario 4: a group a running VM (QEMU) holds is never unbound;
# once QEMU quits it goes back and e1000e drives the NIC again (link up). The
# same when the node leaves VM mode under a running vfio-manager: it restores
# what no VM holds, keeps its restore label, and finishes when QEMU quits.
# vm: needs=qemu,fake-apiserver
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"

step "bind --all" -- vfio-manager bind --all
note "a VM takes the card"
vm_alloc_file /tmp/card.alloc "$CARD_FN0"
t0=$(_tb_now_ms)
vm_hold "QEMU holds the card's group" /tmp/vm.log -- --allocate /tmp/card.alloc
note "node label (bind) to a VM holding the card: $(($(_tb_now_ms) - t0)) ms after bind --all"
run_logged cat /tmp/vm.log
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

note "the VM quits; unbind again"
vm_release "QEMU quits and lets the group go"
run_logged tail -n 3 /tmp/vm.log
step "unbind --all" -- vfio-manager unbind --all
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
nic_works "e1000e drives CARD_FN0 again: link up" "$CARD_FN0"
nic_works "e1000e drives CARD_FN1 again: link up" "$CARD_FN1"
expect_contains "state file: no device left" /run/vfio-manager/state.json '"devices": {}'

note "leaving VM mode while a VM holds the card: run restores the rest and waits for the VM"
NODE=vm-node
NS=vfio-sandbox
DEPLOY=rebellions.ai/npu.deploy.vfio-manager
PENDING=vfio-sandbox.rebellions.ai/vfio-manager.restore-pending
ifconfig lo 127.0.0.1 up 2>/dev/null || ip link set lo up
fake-apiserver serve --listen 127.0.0.1:6443 --kubeconfig /tmp/kubeconfig \
    --node "$NODE" --label "$DEPLOY=true" \
    --daemonset "$NS/vfio-manager" --selector "$DEPLOY=true" --restore-label "$PENDING" \
    --pod "$NS/vfio-manager-a" >/tmp/apiserver.log 2>&1 &
apiserver=$!
wait_for "the stand-in API server serves" 10 -- test -s /tmp/kubeconfig
export KUBECONFIG=/tmp/kubeconfig NODE_NAME=$NODE POD_NAMESPACE=$NS POD_NAME=vfio-manager-a
labelled() { fake-apiserver request GET "/api/v1/nodes/$NODE" | grep -q "\"$PENDING\":\"true\""; }
unlabelled() { ! fake-apiserver request GET "/api/v1/nodes/$NODE" | grep -q "\"$PENDING\""; }
vfio-manager run --resync-interval 1s >/tmp/run.log 2>&1 &
manager=$!
wait_for "run binds the NICs" 30 -- test -e /run/vfio-manager/ready
vm_hold "QEMU holds the card" /tmp/vm2.log -- --allocate /tmp/card.alloc
step "the deploy label is removed (the node leaves VM mode)" -- \
    fake-apiserver request PATCH "/api/v1/nodes/$NODE" "{\"metadata\":{\"labels\":{\"$DEPLOY\":null}}}"
wait_for "run gives SOLO_NIC back" 30 -- sh -c "[ \"\$(basename \"\$(readlink /sys/bus/pci/devices/$SOLO_NIC/driver)\")\" = e1000e ]"
sleep 3
expect_driver "the held CARD_FN0 stays on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "the held CARD_FN1 stays on vfio-pci" "$CARD_FN1" vfio-pci
expect_contains "run says a VM holds the card, and that it restores it later" /tmp/run.log \
    "skipped $CARD_FN0: /dev/vfio/$CARD_GROUP is open (a VM holds the group); its record is kept, it is restored once the VM has stopped"
expect_eq "run says it once, not at every resync" "$(grep -c "skipped $CARD_FN0: " /tmp/run.log)" 1
step "the restore label stands while the VM runs" -- labelled
vm_release "QEMU quits"
wait_for "run gives the card back once the VM is gone" 30 -- sh -c "[ \"\$(basename \"\$(readlink /sys/bus/pci/devices/$CARD_FN0/driver)\")\" = e1000e ]"
wait_for "and removes the restore label" 30 -- unlabelled
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
nic_works "e1000e drives CARD_FN0 again: link up" "$CARD_FN0"
run_logged tail -n 15 /tmp/run.log
kill -TERM "$manager"
wait "$manager"
expect_eq "run exits 0 on SIGTERM" "$?" 0
kill "$apiserver" 2>/dev/null
