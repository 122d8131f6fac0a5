# sandbox-validator scenario 3: booted without intel_iommu=on, iommu fails with a hint.
# vm: no-iommu
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
expect_fail "validator exits 1" 1 -- sandbox-validator
cp "$TB_OUT" /tmp/out
run_logged cat /tmp/out
expect_contains "iommu fails" /tmp/out "iommu                FAIL    /sys/kernel/iommu_groups is empty or missing: the IOMMU is off"
expect_contains "with the kernel-command-line hint" /tmp/out "intel_iommu=on (Intel) or amd_iommu=on (AMD)"
expect_contains "and the group check names the device" /tmp/out "$CARD_FN0 has no IOMMU group"
expect_contains "pointing at the iommu check" /tmp/out "see the iommu check"
expect_fail "vfio-manager refuses too (exit 1)" 1 -- vfio-manager bind --all
expect_contains "vfio-manager explains the IOMMU is off" "$TB_OUT" "the IOMMU is off"
