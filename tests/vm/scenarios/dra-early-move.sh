# sandbox-dra-driver moves a claim's devices before its pod is bound (KEP-5007
# binding conditions) on the real kernel: the NICs on e1000e are published with
# <driver>/VfioReady and VfioFailed and bindsToNode; a claim whose allocation
# waits on them (written here as kube-scheduler writes one: no scheduler runs
# in this VM; the real one's copying of the conditions, its PreBind wait and
# its giving up are checked in tests/k8s and on the guest node) is moved whole
# to vfio-pci at once and the driver sets VfioReady in the claim's
# status.devices; prepare then only writes files. A claim deleted before its
# pod started gets its devices back, also when the deletion races the move (10
# rounds); a claim re-allocated to another device while its move runs ends on
# that device, the old one back (10 rounds, at delays, with and without an
# unallocated step); a claim on a group another claim holds gets VfioFailed,
# naming the holder. Then kill -9 at every step of the early move (failpoints
# build: the claim saved, each member recorded, override, unbind, probe, the
# claim saved as moved): the restarted driver converges (the claim ready) and
# gives everything back when the claim is deleted; and kill -9 at each step of
# that give-back (override, unbind, probe), finished by the restart.
# QEMU takes the early-moved claim's devices from its CDI spec
# (iommufd-cdev does so through iommufd); a claim deleted while a QEMU holds its
# group is given back once QEMU quits.
# vm: needs=sandbox-dra-driver,sandbox-dra-driver-failpoints,kubelet-peer,fake-apiserver,qemu
# vm: timeout=300
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
DRIVER=vfio-sandbox.rebellions.ai
REG=/var/lib/kubelet/plugins_registry
NODE=dra-node
STATE=/run/sandbox-dra-driver/state.json
CDI=/var/run/cdi
dev_name() { echo "pci-$1" | tr ':.' '--'; }

ifconfig lo 127.0.0.1 up 2>/dev/null || ip link set lo up
fake-apiserver serve --listen 127.0.0.1:6443 --kubeconfig /tmp/kubeconfig \
    --node "$NODE" >/tmp/apiserver.log 2>&1 &
wait_for "the stand-in API server serves" 10 -- test -s /tmp/kubeconfig
export KUBECONFIG=/tmp/kubeconfig NODE_NAME=$NODE

starts=0
start_driver() {
    bin=${1:-sandbox-dra-driver}
    starts=$((starts + 1))
    DLOG=/tmp/dra.$starts.log
    "$bin" --prepare-timeout 5s >"$DLOG" 2>&1 &
    driver=$!
    wait_for "$bin serves its registration socket" 20 -- grep -q "serving registration" "$DLOG"
}
peer() { kubelet-peer dra "$@" --registry "$REG"; }
# claim NAME BDF [ARGS...]: a ResourceClaim in namespace vms allocated BDF's
# device, waiting on the driver's binding conditions; its uid.
claim() {
    c_name=$1 c_dev=$(dev_name "$2")
    shift 2
    fake-apiserver claim "vms/$c_name" --result "nic:$DRIVER:$NODE:$c_dev" \
        --binding-condition "$DRIVER/VfioReady" --binding-failure-condition "$DRIVER/VfioFailed" "$@"
}
# ready NAME: wait until the driver set VfioReady on the claim's devices (exit 1
# on VfioFailed).
ready() { fake-apiserver wait "vms/$1" --condition "$DRIVER/VfioReady" --failure-condition "$DRIVER/VfioFailed" --timeout 60; }
delete_claim() { fake-apiserver request DELETE "/apis/resource.k8s.io/v1/namespaces/vms/resourceclaims/$1" >/dev/null; }
# card_back WHEN: the claim given back: the record goes last, after both functions
# are back on e1000e with their overrides cleared.
card_back() {
    wait_for "state: no claim, no device $1" 20 -- sh -c "! grep -q '\"claims\"' '$STATE' && grep -q '\"devices\": {}' '$STATE'"
    expect_driver "CARD_FN0 back on e1000e $1" "$CARD_FN0" e1000e
    expect_driver "CARD_FN1 back on e1000e $1" "$CARD_FN1" e1000e
    expect_contains "CARD_FN0 override cleared $1" "/sys/bus/pci/devices/$CARD_FN0/driver_override" "(null)"
}

note "the slice carries binding conditions for the NICs on e1000e"
start_driver
step "the peer registers the driver" -- peer register
wait_for "the ResourceSlice is published" 10 -- sh -c 'fake-apiserver request GET /apis/resource.k8s.io/v1/resourceslices | grep -q pci-0000'
fake-apiserver request GET /apis/resource.k8s.io/v1/resourceslices >/tmp/slices.json
expect_contains "slice: the ready condition" /tmp/slices.json "\"bindingConditions\":[\"$DRIVER/VfioReady\"]"
expect_contains "slice: the failure condition" /tmp/slices.json "\"bindingFailureConditions\":[\"$DRIVER/VfioFailed\"]"
expect_contains "slice: bound to the node" /tmp/slices.json '"bindsToNode":true'

note "allocated: moved before binding; prepare writes files only; QEMU takes the card"
t0=$(_tb_now_ms)
t_alloc=$t0
uid=$(claim vm-card "$CARD_FN0")
step "the driver sets VfioReady" -- ready vm-card
t1=$(_tb_now_ms)
note "allocation to ready took $((t1 - t0)) ms (polled every 100 ms)"
expect_driver "CARD_FN0 on vfio-pci before the pod is bound" "$CARD_FN0" vfio-pci
expect_driver "CARD_FN1 (companion) on vfio-pci too" "$CARD_FN1" vfio-pci
step "/dev/vfio/$CARD_GROUP is a char device" -- test -c "/dev/vfio/$CARD_GROUP"
fake-apiserver request GET /apis/resource.k8s.io/v1/namespaces/vms/resourceclaims/vm-card >/tmp/claim.json
expect_contains "claim status: our device's condition" /tmp/claim.json "\"type\":\"$DRIVER/VfioReady\""
expect_contains "state: the claim is moved" "$STATE" '"phase": "moved"'
step "no CDI spec before prepare" -- sh -c "! test -e '$CDI/$DRIVER-vfio_$uid.json'"
t0=$(_tb_now_ms)
step "NodePrepareResources v1 for vm-card" -- peer prepare --version v1 --claim "vms/vm-card/$uid"
t1=$(_tb_now_ms)
cp "$TB_OUT" /tmp/prep-card.json
note "prepare after the early move took $((t1 - t0)) ms (peer to answer)"
step "the CDI spec is written" -- test -s "$CDI/$DRIVER-vfio_$uid.json"
expect_contains "state: the claim is prepared" "$STATE" '"phase": "prepared"'
step "QEMU realizes CARD_FN0 from the CDI spec" -- kubelet-peer vmm --cdi-from /tmp/prep-card.json
t2=$(_tb_now_ms)
cp "$TB_OUT" /tmp/vmm-card.out
run_logged cat /tmp/vmm-card.out
expect_contains "CARD_FN0 realized with the host's ids, BAR 0 mapped" /tmp/vmm-card.out "realized $CARD_FN0 8086:10d3 (legacy) BAR0@"
realize_ms=$(sed -n 's/.* realized [0-9]* device(s) in \([0-9]*\) ms.*/\1/p' /tmp/vmm-card.out)
note "time to a VM: path=dra-early-move allocation_to_prepared_ms=$((t1 - t_alloc)) qemu_realize_ms=${realize_ms:-0} qemu_step_ms=$((t2 - t1))"
step "NodeUnprepareResources v1 for vm-card" -- peer unprepare --version v1 --claim "vms/vm-card/$uid"
card_back "after unprepare"
delete_claim vm-card

note "deleted before its pod started: given back"
uid=$(claim vm-gone "$CARD_FN0")
step "vm-gone is ready" -- ready vm-gone
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
step "the claim is deleted" -- delete_claim vm-gone
card_back "after the claim was deleted"

note "deleted while a VM holds the group (opened without a prepare): given back once QEMU quits"
uid=$(claim vm-held "$CARD_FN0")
step "vm-held is ready" -- ready vm-held
vm_alloc_file /tmp/card.alloc "$CARD_FN0"
vm_hold "QEMU holds the card's group" /tmp/vm-held.log -- --allocate /tmp/card.alloc
step "the claim is deleted" -- delete_claim vm-held
wait_for "the driver finds the group held and keeps the card" 20 -- grep -q "cannot give back the devices of a claim moved early" "$DLOG"
expect_driver "CARD_FN0 stays on vfio-pci while QEMU holds it" "$CARD_FN0" vfio-pci
expect_driver "CARD_FN1 stays on vfio-pci while QEMU holds it" "$CARD_FN1" vfio-pci
vm_release "QEMU quits"
# The give-back is tried again every 10 s.
card_back "once QEMU let the group go"
nic_works "e1000e drives CARD_FN0 again: link up" "$CARD_FN0"

note "the race of a move and the claim's deletion, 10 times, the deletion 0 to 180 ms after the allocation"
recorded=0
i=0
while [ $i -lt 10 ]; do
    claim "vm-race-$i" "$CARD_FN0" >/dev/null
    usleep $((i * 20000))
    grep -q "vm-race-$i" "$STATE" 2>/dev/null && recorded=$((recorded + 1))
    delete_claim "vm-race-$i"
    card_back "after race round $i"
    i=$((i + 1))
done
note "$recorded of 10 race rounds had the claim recorded when it was deleted"

note "a claim re-allocated while its move runs (0 to 400 ms after), with and without an unallocated step: it ends ready on its new device, the old one back"
on_driver() { test "$(basename "$(readlink "/sys/bus/pci/devices/$1/driver")")" = "$2"; }
for step_between in "" --deallocate-first; do
    for d in 0 20 60 150 400; do
        name="vm-re-$d${step_between:+-dealloc}"
        claim "$name" "$CARD_FN0" >/dev/null
        usleep $((d * 1000))
        claim "$name" "$SOLO_NIC" --again $step_between >/dev/null
        step "$name is ready on its new device" -- ready "$name"
        expect_driver "SOLO_NIC on vfio-pci for $name" "$SOLO_NIC" vfio-pci
        wait_for "CARD_FN0 back on e1000e after $name moved on" 20 -- on_driver "$CARD_FN0" e1000e
        wait_for "CARD_FN1 back on e1000e after $name moved on" 20 -- on_driver "$CARD_FN1" e1000e
        delete_claim "$name"
        wait_for "state: nothing left after $name" 20 -- sh -c "! grep -q '\"claims\"' '$STATE' && grep -q '\"devices\": {}' '$STATE'"
        expect_driver "SOLO_NIC back on e1000e after $name" "$SOLO_NIC" e1000e
    done
done

note "a group another claim holds: the failure condition, naming the holder"
uid=$(claim vm-holder "$CARD_FN0")
step "vm-holder is ready" -- ready vm-holder
claim vm-thief "$CARD_FN1" >/dev/null
expect_fail "the driver sets VfioFailed on vm-thief" 1 -- ready vm-thief
run_logged cat "$TB_OUT"
expect_contains "it says why" "$TB_OUT" "reason=MoveFailed"
expect_contains "naming the claim that holds the group" "$TB_OUT" "which is prepared for claim vms/vm-holder"
expect_driver "CARD_FN0 stays with vm-holder" "$CARD_FN0" vfio-pci
step "vm-thief is deleted" -- delete_claim vm-thief
step "vm-holder is deleted" -- delete_claim vm-holder
card_back "after vm-holder went"

note "kill -9 at every step of the early move"
for fp in early-after-save bind-after-record bind-after-override bind-after-unbind bind-after-probe early-after-moved; do
    kill -TERM "$driver"
    wait "$driver" 2>/dev/null
    FAILPOINTS="$fp=return" start_driver sandbox-dra-driver-failpoints
    claim "vm-$fp" "$CARD_FN0" >/dev/null
    wait_for "the driver stops at $fp" 20 -- grep -q "failpoint $fp: paused" "$DLOG"
    step "kill -9 the driver at $fp" -- kill -9 "$driver"
    wait "$driver" 2>/dev/null
    run_logged cat "$STATE"
    start_driver
    step "after the kill at $fp the restarted driver makes vm-$fp ready" -- ready "vm-$fp"
    expect_driver "CARD_FN0 on vfio-pci after $fp" "$CARD_FN0" vfio-pci
    expect_driver "CARD_FN1 on vfio-pci after $fp" "$CARD_FN1" vfio-pci
    expect_contains "state: vm-$fp moved after $fp" "$STATE" '"phase": "moved"'
    step "vm-$fp is deleted" -- delete_claim "vm-$fp"
    card_back "after the kill at $fp"
done

note "kill -9 at every step of giving a deleted claim's devices back"
for fp in restore-after-override restore-after-unbind restore-after-probe; do
    kill -TERM "$driver"
    wait "$driver" 2>/dev/null
    FAILPOINTS="$fp=return" start_driver sandbox-dra-driver-failpoints
    claim "vm-$fp" "$CARD_FN0" >/dev/null
    step "vm-$fp is ready" -- ready "vm-$fp"
    step "vm-$fp is deleted" -- delete_claim "vm-$fp"
    wait_for "the driver stops at $fp" 20 -- grep -q "failpoint $fp: paused" "$DLOG"
    step "kill -9 the driver at $fp" -- kill -9 "$driver"
    wait "$driver" 2>/dev/null
    run_logged cat "$STATE"
    start_driver
    card_back "after the kill at $fp"
done

kill -TERM "$driver"
wait "$driver"
expect_eq "SIGTERM: exit 0" "$?" 0
run_logged sh -c 'cat /tmp/dra.*.log | grep -E "moved|gave back|rolled back|early|failpoint"'
