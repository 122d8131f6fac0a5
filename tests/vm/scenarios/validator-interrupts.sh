# sandbox-validator scenario 3: interrupt isolation. On x86, booted with
# intremap=off, the kernel remaps no interrupt: interrupt-isolation fails naming
# the cause and the fix, and QEMU indeed cannot take the device (the kernel
# refuses to attach its group); with vfio_iommu_type1's allow_unsafe_interrupts=1
# it passes with a warning, and QEMU takes it. On arm64 (SMMUv3, GICv3 ITS) the
# ITS isolates MSIs: it passes, and QEMU takes the device.
# vm: needs=qemu cmdline=intremap=off
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
run_logged modprobe vfio-pci
run_logged modprobe vfio_iommu_type1
for bdf in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
    step "bind $bdf by hand" -- bind_override "$bdf" vfio-pci
done
vm_alloc_file /tmp/solo.alloc "$SOLO_NIC"
note "the interrupt chips the kernel lists"
run_logged sh -c 'cat /sys/kernel/irq/*/chip_name | sort | uniq -c'

if [ "$(uname -m)" = aarch64 ]; then
    step "validator passes: the GICv3 ITS isolates MSIs" -- sandbox-validator
    cp "$TB_OUT" /tmp/out
    run_logged cat /tmp/out
    expect_contains "interrupt-isolation names the ITS" /tmp/out \
        "interrupt-isolation  ok      device interrupts are isolated by the GICv3 ITS"
    step "QEMU takes SOLO_NIC" -- kubelet-peer vmm --allocate /tmp/solo.alloc
    expect_contains "SOLO_NIC realized" "$TB_OUT" "realized $SOLO_NIC 8086:10d3"
else
    expect_fail "validator exits 1" 1 -- sandbox-validator
    cp "$TB_OUT" /tmp/out
    run_logged cat /tmp/out
    expect_contains "interrupt-isolation fails naming what the kernel lists" /tmp/out \
        "interrupt-isolation  FAIL    no interrupt domain isolates device MSIs (interrupt chips: "
    expect_contains "the IO-APIC is not remapped" /tmp/out "IO-APIC"
    expect_contains "the fix names intremap=off" /tmp/out "remove intremap=off from the kernel command line"
    expect_contains "the only failed check" /tmp/out "node is NOT ready: 1 check(s) failed"
    expect_fail "no ready file" 1 -- test -e /run/vfio-sandbox/validations/vfio-pci-ready
    expect_fail "QEMU cannot take SOLO_NIC" 1 -- kubelet-peer vmm --allocate /tmp/solo.alloc
    cp "$TB_OUT" /tmp/vmm.out
    run_logged cat /tmp/vmm.out
    expect_contains "QEMU: the kernel refused the group" /tmp/vmm.out "Operation not permitted"
    dmesg >/tmp/dmesg.out
    expect_contains "the kernel says why" /tmp/dmesg.out "No interrupt remapping support"

    step "allow_unsafe_interrupts=1" -- \
        sysfs_write /sys/module/vfio_iommu_type1/parameters/allow_unsafe_interrupts 1
    step "validator passes, with a warning" -- sandbox-validator
    cp "$TB_OUT" /tmp/out
    run_logged cat /tmp/out
    expect_contains "interrupt-isolation warns" /tmp/out "interrupt-isolation  WARN    no interrupt domain isolates device MSIs"
    expect_contains "the warning says what it gives up" /tmp/out \
        "warning: vfio_iommu_type1.allow_unsafe_interrupts=1 lets VMs take devices without interrupt isolation"
    step "QEMU takes SOLO_NIC" -- kubelet-peer vmm --allocate /tmp/solo.alloc
    expect_contains "SOLO_NIC realized" "$TB_OUT" "realized $SOLO_NIC 8086:10d3"
fi
