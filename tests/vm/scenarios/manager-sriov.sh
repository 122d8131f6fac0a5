# vfio-manager scenario 6: a PF with VFs enabled is refused with a clear error and
# nothing changes; its VFs bind.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
# QEMU's nvme VFs carry the PF's ids (1b36:0010).
echo '{"resources":[{"name":"example.com/NVME_PT","vendor":"1b36","devices":["0010"]}]}' >"$VFIO_SANDBOX_CONFIG"

# sriov_enable waits until nvme's probe of the (offline) VFs has settled.
step "enable 2 VFs" -- sriov_enable "$NVME_PF" 2
vf0_before=$(driver_of "$NVME_VF0")
run_logged vfio-manager status

note "the PF is refused"
expect_fail "bind --device NVME_PF exits 1" 1 -- vfio-manager bind --device "$NVME_PF"
cp "$TB_OUT" /tmp/pf.out
run_logged cat /tmp/pf.out
expect_contains "error names the PF and its VFs" /tmp/pf.out "cannot bind $NVME_PF: it is an SR-IOV physical function with 2 VFs enabled"
expect_contains "error names the file" /tmp/pf.out "/sys/bus/pci/devices/$NVME_PF/sriov_numvfs"
expect_driver "PF still on nvme" "$NVME_PF" nvme
expect_eq "PF override untouched" "$(cat /sys/bus/pci/devices/$NVME_PF/driver_override)" "(null)"
expect_eq "VF0 untouched" "$(driver_of "$NVME_VF0")" "$vf0_before"
step "no device recorded" -- sh -c '! grep -q "original_driver" /run/vfio-manager/state.json 2>/dev/null'

note "bind --all binds the VFs and reports the PF"
expect_fail "bind --all exits 1 (the PF)" 1 -- vfio-manager bind --all
run_logged cat "$TB_OUT"
expect_driver "VF0 on vfio-pci" "$NVME_VF0" vfio-pci
expect_driver "VF1 on vfio-pci" "$NVME_VF1" vfio-pci
expect_driver "PF still on nvme" "$NVME_PF" nvme
step "/dev/vfio node for VF0's group" -- test -c "/dev/vfio/$(group_of "$NVME_VF0")"

note "restore the VFs"
step "unbind --all" -- vfio-manager unbind --all
expect_eq "VF0 back where it was" "$(driver_of "$NVME_VF0")" "$vf0_before"
