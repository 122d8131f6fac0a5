# sandbox-validator scenario 2: one function of the two-function card bound by hand,
# the other left on e1000e: groups-viable fails naming the member that breaks the
# group and its driver; QEMU, handed that group, refuses to start for the same
# reason, and takes the device whose group is whole.
# vm: needs=qemu
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
run_logged modprobe vfio-pci
run_logged modprobe vfio_iommu_type1
step "bind only CARD_FN0 by hand" -- bind_override "$CARD_FN0" vfio-pci
step "bind SOLO_NIC by hand" -- bind_override "$SOLO_NIC" vfio-pci
expect_driver "CARD_FN1 left on e1000e" "$CARD_FN1" e1000e
expect_fail "validator exits 1" 1 -- sandbox-validator
cp "$TB_OUT" /tmp/out
run_logged cat /tmp/out
expect_contains "groups-viable names CARD_FN1 and its driver" /tmp/out \
    "groups-viable        FAIL    group $CARD_GROUP: selected device $CARD_FN1 is on e1000e"
expect_contains "hint: move the whole group" /tmp/out "vfio-manager bind --device"
expect_fail "no ready file" 1 -- test -e /run/vfio-sandbox/validations/vfio-pci-ready
sandbox-validator --output json >/tmp/out.json 2>&1
expect_contains "json output says not ready" /tmp/out.json '"ready":false'
vm_alloc_file /tmp/card.alloc "$CARD_FN0"
expect_fail "QEMU refuses CARD_FN0 too" 1 -- kubelet-peer vmm --allocate /tmp/card.alloc
cp "$TB_OUT" /tmp/vmm-card.out
run_logged cat /tmp/vmm-card.out
expect_contains "QEMU: the group is not viable" /tmp/vmm-card.out "group $CARD_GROUP is not viable"
vm_alloc_file /tmp/solo.alloc "$SOLO_NIC"
step "QEMU takes SOLO_NIC, whose group is whole" -- kubelet-peer vmm --allocate /tmp/solo.alloc
expect_contains "SOLO_NIC realized" "$TB_OUT" "realized $SOLO_NIC 8086:10d3"

note "a true companion: the selected device bound, its audio function left on snd_hda_intel"
echo '{"resources":[{"name":"example.com/GPU_PT","vendor":"1af4","devices":["1044"]}]}' >/tmp/gpu.json
step "bind only GPU_FN0 by hand" -- bind_override "$GPU_FN0" vfio-pci
expect_fail "validator exits 1" 1 -- sandbox-validator --config /tmp/gpu.json
cp "$TB_OUT" /tmp/gpu.out
run_logged cat /tmp/gpu.out
expect_contains "groups-viable names the companion and its driver" /tmp/gpu.out \
    "groups-viable        FAIL    group $GPU_GROUP: companion $GPU_AUDIO is on snd_hda_intel"
expect_contains "devices-bound passes: the selected device is bound" /tmp/gpu.out "devices-bound        ok"
vm_alloc_file /tmp/gpu.alloc "$GPU_FN0"
expect_fail "QEMU refuses GPU_FN0 while its audio function is on snd_hda_intel" 1 -- \
    kubelet-peer vmm --allocate /tmp/gpu.alloc
cp "$TB_OUT" /tmp/vmm-gpu.out
run_logged cat /tmp/vmm-gpu.out
expect_contains "QEMU: the group is not viable" /tmp/vmm-gpu.out "group $GPU_GROUP is not viable"
