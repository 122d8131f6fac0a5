# sandbox-dra-driver on the real kernel: the stand-in API server and the
# kubelet-like peer in the guest, the driver registered with the peer and its
# ResourceSlice published; a claim for the two-function card moves both functions
# (the whole IOMMU group) to vfio-pci with the group node, CDI spec and metadata
# file in place, QEMU in a container given the claim's CDI devices takes the
# card, and unprepare gives them back to e1000e. Then: the card and a
# second device prepared for two claims at once (v1beta1), a third claim on the
# card's group refused, a group a running QEMU holds refusing unprepare until
# the VM quits (then e1000e drives the NICs again),
# kill -9 between steps and in the middle of a bind (failpoints build) followed
# by a restart that converges, and a stop that keeps or deletes the slice.
# vm: needs=sandbox-dra-driver,sandbox-dra-driver-failpoints,kubelet-peer,fake-apiserver,qemu
# vm: timeout=300
# shellcheck shell=sh
# Every move here happens at prepare, as on a cluster without binding conditions;
# dra-early-move.sh moves claims as soon as they are allocated.
export VFIO_SANDBOX_BINDING_CONDITIONS=off

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
DRIVER=vfio-sandbox.rebellions.ai
REG=/var/lib/kubelet/plugins_registry
NODE=dra-node
NS=vfio-sandbox-dra
STATE=/run/sandbox-dra-driver/state.json
CDI=/var/run/cdi
META=/var/run/kubernetes.io/dra-device-attributes/$DRIVER
LABEL=rebellions.ai/npu.deploy.sandbox-dra-driver
dev_name() { echo "pci-$1" | tr ':.' '--'; }
SOLO_GROUP=$(group_of "$SOLO_NIC")

ifconfig lo 127.0.0.1 up 2>/dev/null || ip link set lo up
fake-apiserver serve --listen 127.0.0.1:6443 --kubeconfig /tmp/kubeconfig \
    --node "$NODE" --label "$LABEL=true" \
    --daemonset "$NS/sandbox-dra-driver" --selector "$LABEL=true" \
    --pod "$NS/dra-pod1" >/tmp/apiserver.log 2>&1 &
wait_for "the stand-in API server serves" 10 -- test -s /tmp/kubeconfig
export KUBECONFIG=/tmp/kubeconfig NODE_NAME=$NODE POD_NAMESPACE=$NS POD_NAME=dra-pod1

# start_driver [BINARY [FLAGS...]]: start the driver (its log is $DLOG), wait
# until it serves (a killed one leaves its socket files behind).
starts=0
start_driver() {
    bin=${1:-sandbox-dra-driver}
    [ $# -gt 0 ] && shift
    starts=$((starts + 1))
    DLOG=/tmp/dra.$starts.log
    "$bin" --prepare-timeout 5s "$@" >"$DLOG" 2>&1 &
    driver=$!
    wait_for "$bin serves its registration socket" 20 -- grep -q "serving registration" "$DLOG"
}
peer() { kubelet-peer dra "$@" --registry "$REG"; }
# claim NAME BDF...: an allocated ResourceClaim in namespace vms; prints its uid.
claim() {
    c_name=$1
    shift
    c_args=""
    for b in "$@"; do c_args="$c_args --result nic:$DRIVER:$NODE:$(dev_name "$b")"; done
    # shellcheck disable=SC2086
    fake-apiserver claim "vms/$c_name" $c_args
}
slices() { fake-apiserver request GET /apis/resource.k8s.io/v1/resourceslices >/tmp/slices.json; }

note "registration and the ResourceSlice"
start_driver
expect_fail "readiness probe: not ready before kubelet registered it" 1 -- sandbox-dra-driver ready
step "the peer registers the driver" -- peer register
cp "$TB_OUT" /tmp/reg.json
run_logged cat /tmp/reg.json
expect_contains "GetInfo: a DRA plugin" /tmp/reg.json '"type":"DRAPlugin","name":"vfio-sandbox.rebellions.ai"'
expect_contains "GetInfo: its endpoint" /tmp/reg.json "\"endpoint\":\"/var/lib/kubelet/plugins/$DRIVER/dra.sock\""
expect_contains "GetInfo: v1 first, then v1beta1, then both health services" /tmp/reg.json \
    '"supported_versions":["v1.DRAPlugin","v1beta1.DRAPlugin","v1.DRAResourceHealth","v1alpha1.DRAResourceHealth"],"chosen":"v1"'
wait_for "the ResourceSlices are published (devices, then counter sets)" 10 -- sh -c \
    "fake-apiserver request GET /apis/resource.k8s.io/v1/resourceslices | grep -q iommu-group-$CARD_GROUP"
slices
for b in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
    expect_contains "slice offers $b" /tmp/slices.json "\"resource.kubernetes.io/pciBusID\":{\"string\":\"$b\"}"
done
expect_contains "slice: this node's pool" /tmp/slices.json "\"nodeName\":\"$NODE\""
expect_contains "slice: the card's IOMMU group" /tmp/slices.json "\"iommuGroup\":{\"int\":$CARD_GROUP}"
expect_contains "slice: the card's group whole, as one more device" /tmp/slices.json \
    "\"name\":\"group-$(dev_name "$CARD_FN0" | sed 's/^pci-//')\""
expect_contains "slice: the card's group is one counter set its devices take whole" /tmp/slices.json \
    "\"name\":\"iommu-group-$CARD_GROUP\""
step "slice: the NVMe (not selected) is not offered" -- sh -c "! grep -q $NVME_PF /tmp/slices.json"
wait_for "readiness probe: ready once registered and published" 10 -- sandbox-dra-driver ready

note "prepare the card's claim (v1): the whole group moves"
uid_card=$(claim vm-card "$CARD_FN0")
t0=$(_tb_now_ms)
step "NodePrepareResources v1 for vm-card" -- peer prepare --version v1 --claim "vms/vm-card/$uid_card"
t1=$(_tb_now_ms)
cp "$TB_OUT" /tmp/prep-card.json
run_logged cat /tmp/prep-card.json
note "prepare took $((t1 - t0)) ms (peer to answer)"
expect_contains "answer: the device and its CDI id" /tmp/prep-card.json \
    "\"device_name\":\"$(dev_name "$CARD_FN0")\",\"cdi_device_ids\":[\"$DRIVER/vfio=$(dev_name "$CARD_FN0")-$uid_card\""
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "CARD_FN1 (companion) on vfio-pci" "$CARD_FN1" vfio-pci
step "/dev/vfio/$CARD_GROUP is a char device" -- test -c "/dev/vfio/$CARD_GROUP"
expect_driver "SOLO_NIC untouched" "$SOLO_NIC" e1000e
spec=$CDI/$DRIVER-vfio_$uid_card.json
run_logged cat "$spec"
expect_contains "CDI spec gives /dev/vfio/vfio" "$spec" '"path": "/dev/vfio/vfio"'
expect_contains "CDI spec gives the group node" "$spec" "\"path\": \"/dev/vfio/$CARD_GROUP\""
expect_contains "CDI spec sets KubeVirt's variable as the device plugin's Allocate does" "$spec" \
    "\"PCI_RESOURCE_EXAMPLE_COM_NIC_PT=$CARD_FN0\""
expect_contains "CDI spec mounts the metadata file where KubeVirt >= 1.8.3 reads it" "$spec" \
    "\"containerPath\": \"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-card/nic/$DRIVER-metadata.json\""
expect_contains "CDI spec mounts it where KubeVirt 1.8.0-1.8.2 read it" "$spec" \
    "\"containerPath\": \"/var/run/dra-device-attributes/vm-card/nic/$DRIVER-metadata.json\""
meta=$META/$uid_card/nic/metadata.json
run_logged cat "$meta"
expect_contains "metadata carries the pciBusID" "$meta" "\"string\": \"$CARD_FN0\""
expect_contains "state: the claim is prepared" "$STATE" '"phase": "prepared"'
step "prepare again (kubelet retries): the same answer" -- peer prepare --version v1 --claim "vms/vm-card/$uid_card"
expect_eq "the same answer" "$(cat "$TB_OUT")" "$(cat /tmp/prep-card.json)"

note "a VM takes the claim: QEMU in a container given its CDI devices"
step "QEMU realizes CARD_FN0 from the CDI spec" -- kubelet-peer vmm --cdi-from /tmp/prep-card.json
cp "$TB_OUT" /tmp/vmm-card.out
run_logged cat /tmp/vmm-card.out
expect_contains "CARD_FN0 realized with the host's ids, BAR 0 mapped" /tmp/vmm-card.out "realized $CARD_FN0 8086:10d3 (legacy) BAR0@"
realize_ms=$(sed -n 's/.* realized [0-9]* device(s) in \([0-9]*\) ms.*/\1/p' /tmp/vmm-card.out)
note "time to a VM: path=dra-prepare prepare_ms=$((t1 - t0)) qemu_realize_ms=${realize_ms:-0}"

note "device health as kubelet reads it: the prepared card leaves vfio-pci and comes back"
card_key="$NODE/$(dev_name "$CARD_FN0")"
step "health stream: the prepared card is Healthy" -- peer health --until "$card_key=Healthy"
peer health --until "$card_key=Unhealthy" --within 10s >/tmp/health-down.json 2>&1 &
health_pid=$!
sleep 0.5
step "CARD_FN0 is unbound from vfio-pci behind the driver's back" -- \
    sysfs_write "/sys/bus/pci/devices/$CARD_FN0/driver/unbind" "$CARD_FN0"
wait "$health_pid"
expect_eq "kubelet's peer sees it Unhealthy" "$?" 0
run_logged tail -n 1 /tmp/health-down.json
expect_contains "with why" /tmp/health-down.json "is prepared for a VM but on no driver instead of vfio-pci"
peer health --until "$card_key=Healthy" --within 10s >/tmp/health-up.json 2>&1 &
health_pid=$!
sleep 0.5
step "drivers_probe puts it back on vfio-pci (its override still says so)" -- \
    sysfs_write /sys/bus/pci/drivers_probe "$CARD_FN0"
wait "$health_pid"
expect_eq "kubelet's peer sees it Healthy again" "$?" 0
expect_driver "CARD_FN0 on vfio-pci again" "$CARD_FN0" vfio-pci

note "unprepare: back to e1000e"
logged=$(wc -l <"$DLOG")
t0=$(_tb_now_ms)
step "NodeUnprepareResources v1 for vm-card" -- peer unprepare --version v1 --claim "vms/vm-card/$uid_card"
t1=$(_tb_now_ms)
note "unprepare took $((t1 - t0)) ms (peer to answer)"
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
# The node watcher sees the unbind and the probe while the claim is still on its
# way back: a device where it should be is not reported unhealthy meanwhile.
sleep 1
tail -n "+$((logged + 1))" "$DLOG" >/tmp/after-unprepare.log
expect_not_contains "no device reported unhealthy on its way back to e1000e" \
    /tmp/after-unprepare.log "device unhealthy"
step "CDI spec removed" -- sh -c "! test -e '$spec'"
step "metadata removed" -- sh -c "! test -e '$META/$uid_card'"
step "unprepare again: done already" -- peer unprepare --version v1 --claim "vms/vm-card/$uid_card"

note "two claims at once (v1beta1), and a third on the card's group"
uid_card=$(claim vm-card2 "$CARD_FN0")
uid_solo=$(claim vm-solo "$SOLO_NIC")
step "prepare vm-card2 and vm-solo in one call" -- peer prepare --version v1beta1 \
    --claim "vms/vm-card2/$uid_card" --claim "vms/vm-solo/$uid_solo"
cp "$TB_OUT" /tmp/prep-two.json
run_logged cat /tmp/prep-two.json
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "CARD_FN1 on vfio-pci" "$CARD_FN1" vfio-pci
expect_driver "SOLO_NIC on vfio-pci" "$SOLO_NIC" vfio-pci
step "/dev/vfio/$SOLO_GROUP is a char device" -- test -c "/dev/vfio/$SOLO_GROUP"
uid_thief=$(claim vm-thief "$CARD_FN1")
expect_fail "a claim on the card's other function is refused" 1 -- \
    peer prepare --version v1 --claim "vms/vm-thief/$uid_thief"
expect_contains "the refusal names the owner" "$TB_OUT" "which is prepared for claim vms/vm-card2"
expect_fail "an unknown uid is refused" 1 -- peer prepare --version v1 --claim "vms/vm-solo/not-its-uid"
expect_contains "the refusal names both uids" "$TB_OUT" "kubelet asked for not-its-uid"

note "a VM holds the card's group: unprepare waits for it"
# vm-card2's CDI devices only (its device's and its request's), as its pod gets them.
card_ids=$(grep -o "\"$DRIVER/vfio=[^\"]*-$uid_card\"" /tmp/prep-two.json | sort -u | sed 's/^"/--cdi /; s/"$//' | tr '\n' ' ')
# shellcheck disable=SC2086 # one word per flag and id
vm_hold "QEMU holds vm-card2's card" /tmp/vm-card2.log -- $card_ids
run_logged cat /tmp/vm-card2.log
expect_fail "unprepare vm-card2 fails while the group is held" 1 -- \
    peer unprepare --version v1 --claim "vms/vm-card2/$uid_card"
expect_contains "the error names the group node" "$TB_OUT" "/dev/vfio/$CARD_GROUP still open"
expect_driver "held CARD_FN0 stays on vfio-pci" "$CARD_FN0" vfio-pci
vm_release "QEMU quits"
step "unprepare vm-card2 once the VM is gone" -- peer unprepare --version v1 --claim "vms/vm-card2/$uid_card"
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
nic_works "e1000e drives CARD_FN0 again: link up" "$CARD_FN0"
nic_works "e1000e drives CARD_FN1 again: link up" "$CARD_FN1"

note "kill -9 between steps: a restarted driver still restores"
step "kill -9 the driver (vm-solo prepared)" -- kill -9 "$driver"
wait "$driver" 2>/dev/null
start_driver
step "unprepare vm-solo after the restart" -- peer unprepare --version v1 --claim "vms/vm-solo/$uid_solo"
expect_driver "SOLO_NIC back on e1000e" "$SOLO_NIC" e1000e

note "kill -9 in the middle of a bind (after CARD_FN0's unbind)"
kill -TERM "$driver"
wait "$driver" 2>/dev/null
FAILPOINTS=bind-after-unbind=return start_driver sandbox-dra-driver-failpoints
uid_card=$(claim vm-card3 "$CARD_FN0")
expect_fail "prepare is bounded: it answers after --prepare-timeout" 1 -- \
    peer prepare --version v1 --claim "vms/vm-card3/$uid_card"
expect_contains "the answer says what is still running" "$TB_OUT" "not done within 5s (preparing claim vms/vm-card3"
wait_for "the driver stops after the unbind" 10 -- grep -q "failpoint bind-after-unbind: paused" "$DLOG"
run_logged cat "$STATE"
step "kill -9 the driver there" -- kill -9 "$driver"
wait "$driver" 2>/dev/null
expect_driver "CARD_FN0 is on no driver now" "$CARD_FN0" none
start_driver
wait_for "the restart rolled the claim back" 10 -- grep -q "found half-prepared after a restart; rolled back" "$DLOG"
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
step "kubelet's retry prepares it" -- peer prepare --version v1 --claim "vms/vm-card3/$uid_card"
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
step "and unprepares it" -- peer unprepare --version v1 --claim "vms/vm-card3/$uid_card"
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
step "state: no claim, no device left" -- sh -c "! grep -q '\"claims\"' '$STATE' && grep -q '\"devices\": {}' '$STATE'"

note "stop: a rollout keeps the slice, an uninstall deletes it"
kill -TERM "$driver"
wait "$driver"
expect_eq "SIGTERM: exit 0" "$?" 0
slices
expect_contains "rollout: the slice stays" /tmp/slices.json "pci-0000"
start_driver
step "uninstall: the DaemonSet is deleted" -- \
    fake-apiserver request DELETE "/apis/apps/v1/namespaces/$NS/daemonsets/sandbox-dra-driver"
kill -TERM "$driver"
wait "$driver"
slices
step "uninstall: no slice left" -- sh -c "! grep -q pci-0000 /tmp/slices.json"
step "the sockets are gone" -- sh -c "! test -e '$REG/$DRIVER-reg.sock'"
run_logged sh -c 'cat /tmp/dra.*.log | grep -E "prepared|unprepared|rolled back|ResourceSlice|stopping"'
