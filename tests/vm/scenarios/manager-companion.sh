# vfio-manager with a true companion: a device and its audio function share an
# IOMMU group but only the device is selected. Binding takes the audio function
# along (off snd_hda_intel), restoring puts each back on its own native driver.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/GPU_PT","vendor":"1af4","devices":["1044"]}]}' >"$VFIO_SANDBOX_CONFIG"

run_logged vfio-manager status
vfio-manager status >/tmp/status.out
expect_contains "status lists the audio function as a companion" /tmp/status.out "(companion of $GPU_FN0)"
expect_contains "status names the companion's driver" /tmp/status.out "snd_hda_intel (want vfio-pci)"
expect_fail "validator fails before binding" 1 -- sandbox-validator
expect_contains "validator names the companion and its driver" "$TB_OUT" \
    "group $GPU_GROUP: companion $GPU_AUDIO is on snd_hda_intel"

note "bind --all: the companion goes along"
step "bind --all" -- vfio-manager bind --all
run_logged cat "$TB_OUT"
expect_driver "GPU_FN0 on vfio-pci" "$GPU_FN0" vfio-pci
expect_driver "GPU_AUDIO (companion) on vfio-pci" "$GPU_AUDIO" vfio-pci
step "/dev/vfio/$GPU_GROUP is a char device" -- test -c "/dev/vfio/$GPU_GROUP"
expect_driver "the unselected card is untouched" "$CARD_FN0" e1000e
run_logged cat /run/vfio-manager/state.json
expect_contains "state records the companion's role" /run/vfio-manager/state.json '"role": "companion"'
expect_contains "state records snd_hda_intel as its original driver" /run/vfio-manager/state.json '"original_driver": "snd_hda_intel"'
vfio-manager status --output json >/tmp/status.json
expect_contains "status json: the group is viable" /tmp/status.json '"group_viable": true'
step "validator passes" -- sandbox-validator
run_logged cat "$TB_OUT"

note "unbind --all: each back on its own driver"
step "unbind --all" -- vfio-manager unbind --all
run_logged cat "$TB_OUT"
expect_driver "GPU_FN0 back on virtio-pci" "$GPU_FN0" virtio-pci
expect_driver "GPU_AUDIO back on snd_hda_intel" "$GPU_AUDIO" snd_hda_intel
