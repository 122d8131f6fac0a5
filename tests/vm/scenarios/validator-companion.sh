# sandbox-validator scenario 2: one function of the two-function card bound by hand,
# the other left on e1000e: groups-viable fails naming the member that breaks the
# group and its driver.
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
    "groups-viable   FAIL    group $CARD_GROUP: selected device $CARD_FN1 is on e1000e"
expect_contains "hint: move the whole group" /tmp/out "vfio-manager bind --device"
expect_fail "no ready file" 1 -- test -e /run/vfio-sandbox/validations/vfio-pci-ready
sandbox-validator --output json >/tmp/out.json 2>&1
expect_contains "json output says not ready" /tmp/out.json '"ready":false'

note "a true companion: the selected device bound, its audio function left on snd_hda_intel"
echo '{"resources":[{"name":"example.com/GPU_PT","vendor":"1af4","devices":["1044"]}]}' >/tmp/gpu.json
step "bind only GPU_FN0 by hand" -- bind_override "$GPU_FN0" vfio-pci
expect_fail "validator exits 1" 1 -- sandbox-validator --config /tmp/gpu.json
cp "$TB_OUT" /tmp/gpu.out
run_logged cat /tmp/gpu.out
expect_contains "groups-viable names the companion and its driver" /tmp/gpu.out \
    "groups-viable   FAIL    group $GPU_GROUP: companion $GPU_AUDIO is on snd_hda_intel"
expect_contains "devices-bound passes: the selected device is bound" /tmp/gpu.out "devices-bound   ok"
