# Smoke test of the test bed itself: shell and sysfs only, no project binary.
#
# Proves the device map (IOMMU groups, native drivers, SR-IOV), that vfio is
# not loaded at start, and that the kernel contract for moving a device to
# vfio-pci and back works on this kernel.
# shellcheck shell=sh

note "IOMMU groups and the device map"
# shellcheck disable=SC2016  # expanded by the child shell
step "IOMMU groups exist" -- sh -c '[ -n "$(ls /sys/kernel/iommu_groups)" ]'
expect_ne "card has an IOMMU group" "$CARD_GROUP" ""
expect_eq "CARD_FN1 shares CARD_FN0's group" "$(group_of "$CARD_FN1")" "$CARD_GROUP"
expect_eq "card group holds exactly the two functions" \
    "$(group_members "$CARD_GROUP" | tr '\n' ' ')" "$CARD_FN0 $CARD_FN1 "
expect_ne "SOLO_NIC is in another group" "$(group_of "$SOLO_NIC")" "$CARD_GROUP"
expect_ne "SOLO_NIC has a group" "$(group_of "$SOLO_NIC")" none
expect_driver "CARD_FN0 on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 on e1000e" "$CARD_FN1" e1000e
expect_driver "SOLO_NIC on e1000e" "$SOLO_NIC" e1000e
expect_driver "NVME_PF on nvme" "$NVME_PF" nvme
expect_ne "GPU_FN0 has a group" "$GPU_GROUP" ""
expect_eq "GPU_AUDIO shares GPU_FN0's group" "$(group_of "$GPU_AUDIO")" "$GPU_GROUP"
expect_eq "GPU group holds exactly the two functions" \
    "$(group_members "$GPU_GROUP" | tr '\n' ' ')" "$GPU_FN0 $GPU_AUDIO "
expect_driver "GPU_FN0 on virtio-pci" "$GPU_FN0" virtio-pci
expect_driver "GPU_AUDIO on snd_hda_intel" "$GPU_AUDIO" snd_hda_intel
step "NVME_PF supports at least 2 VFs" -- \
    sh -c "[ \"\$(cat /sys/bus/pci/devices/$NVME_PF/sriov_totalvfs)\" -ge 2 ]"
for m in vfio vfio_pci vfio_pci_core vfio_iommu_type1; do
    expect_fail "module $m not loaded at start" 1 -- module_loaded "$m"
done

note "bind the card to vfio-pci (driver_override, unbind, drivers_probe)"
run_logged modprobe vfio-pci
step "vfio-pci loaded" -- module_loaded vfio_pci
step "vfio_iommu_type1 loaded as vfio's soft dependency" -- module_loaded vfio_iommu_type1
step "bind CARD_FN0 to vfio-pci" -- bind_override "$CARD_FN0" vfio-pci
step "bind CARD_FN1 to vfio-pci" -- bind_override "$CARD_FN1" vfio-pci
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "CARD_FN1 on vfio-pci" "$CARD_FN1" vfio-pci
step "/dev/vfio/$CARD_GROUP is a char device" -- test -c "/dev/vfio/$CARD_GROUP"
step "/dev/vfio/vfio is a char device" -- test -c /dev/vfio/vfio
expect_driver "SOLO_NIC untouched" "$SOLO_NIC" e1000e
run_logged ls -l /dev/vfio

note "restore the card to e1000e"
step "restore CARD_FN0" -- clear_override "$CARD_FN0"
step "restore CARD_FN1" -- clear_override "$CARD_FN1"
expect_driver "CARD_FN0 back on e1000e" "$CARD_FN0" e1000e
expect_driver "CARD_FN1 back on e1000e" "$CARD_FN1" e1000e
expect_eq "CARD_FN0 driver_override cleared" \
    "$(cat "/sys/bus/pci/devices/$CARD_FN0/driver_override")" "(null)"
wait_for "/dev/vfio/$CARD_GROUP removed" 5 -- sh -c "! test -e /dev/vfio/$CARD_GROUP"

note "SR-IOV on the nvme PF"
step "enable 2 VFs" -- sriov_enable "$NVME_PF" 2
expect_eq "VF BDFs" "$(tr '\n' ' ' <"$TB_OUT")" "$NVME_VF0 $NVME_VF1 "
for vf in "$NVME_VF0" "$NVME_VF1"; do
    step "VF $vf exists" -- pci_exists "$vf"
    expect_eq "VF $vf physfn is NVME_PF" \
        "$(basename "$(readlink "/sys/bus/pci/devices/$vf/physfn")")" "$NVME_PF"
    expect_ne "VF $vf has an IOMMU group" "$(group_of "$vf")" none
    expect_ne "VF $vf is not in the PF's group" "$(group_of "$vf")" "$(group_of "$NVME_PF")"
done
expect_eq "PF lists 2 VFs" "$(cat "/sys/bus/pci/devices/$NVME_PF/sriov_numvfs")" 2
run_logged sh -c "for d in /sys/bus/pci/devices/$NVME_PF/virtfn*; do v=\$(basename \$(readlink \$d)); echo \"\$(basename \$d) -> \$v group \$(basename \$(readlink \$d/iommu_group)) driver \$(basename \$(readlink /sys/bus/pci/devices/\$v/driver 2>/dev/null) 2>/dev/null)\"; done"
step "disable the VFs" -- sriov_disable "$NVME_PF"
step "VFs removed" -- sh -c "! test -e /sys/bus/pci/devices/$NVME_VF0"
