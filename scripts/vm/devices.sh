# Device map of the VM test bed (sourced, bash). Single source of truth for
# the QEMU device options and the BDFs the guest sees.
# shellcheck shell=bash
#
#   pcie.0 00:04.0  pcie-root-port rp_card (chassis 1, slot 1) -> bus 01
#     01:00.0  e1000e, multifunction=on   CARD_FN0  } one IOMMU group:
#     01:00.1  e1000e                     CARD_FN1  } the "GPU + audio" card
#   pcie.0 00:05.0  pcie-root-port rp_solo (chassis 2, slot 2) -> bus 02
#     02:00.0  e1000e                     SOLO_NIC  (own IOMMU group)
#   pcie.0 00:06.0  pcie-root-port rp_nvme (chassis 3, slot 3) -> bus 03
#     03:00.0  nvme PF, SR-IOV, 2 VFs      NVME_PF
#     03:00.1  nvme VF 0 (after sriov_numvfs=2)   NVME_VF0
#     03:00.2  nvme VF 1 (after sriov_numvfs=2)   NVME_VF1
#   pcie.0 00:07.0  pcie-root-port rp_gpu (chassis 4, slot 4) -> bus 04
#     04:00.0  virtio-rng, multifunction=on  GPU_FN0   } one IOMMU group: a
#     04:00.1  ICH9 HD Audio                 GPU_AUDIO } device and its audio
#              function with different ids and drivers (virtio-pci,
#              snd_hda_intel), so the audio function is a true companion
#   pcie.0 00:08.0  pcie-root-port rp_virtio (chassis 5, slot 5) -> bus 05,
#                   on the iommufd kernel only (run.sh --kernel iommufd)
#     05:00.0  virtio-net-pci, disable-legacy=on (1af4:1041)  VIRTIO_NIC
#              the id of the virtio_vfio_pci variant driver's alias
#              (drivers/vfio/pci/virtio/main.c: virtiovf_pci_table)
#
# Secondary bus numbers follow the root ports' order on pcie.0, so they stay
# as above as long as no PCI bridge is added in front of these ports.

# shellcheck disable=SC2034  # used by run.sh
VM_CARD_FN0=0000:01:00.0
# shellcheck disable=SC2034
VM_CARD_FN1=0000:01:00.1
# shellcheck disable=SC2034
VM_SOLO_NIC=0000:02:00.0
# shellcheck disable=SC2034
VM_NVME_PF=0000:03:00.0
# The nvme PF reports First VF Offset 1 and VF Stride 1.
# shellcheck disable=SC2034
VM_NVME_VF0=0000:03:00.1
# shellcheck disable=SC2034
VM_NVME_VF1=0000:03:00.2
# shellcheck disable=SC2034
VM_GPU_FN0=0000:04:00.0
# shellcheck disable=SC2034
VM_GPU_AUDIO=0000:04:00.1
# shellcheck disable=SC2034
VM_VIRTIO_NIC=0000:05:00.0

# vm_extra_modules KERNEL -- modules the initramfs of KERNEL (a --kernel name)
# holds besides VM_MODULES: iommufd and the variant driver on the iommufd
# kernel; none on Debian's, which build neither.
vm_extra_modules() {
    [[ "$1" == iommufd ]] && echo "iommufd virtio_vfio_pci"
    return 0
}

# On arm64 (qemu-system-aarch64 -machine virt) the same root ports and
# devices sit on the virt machine's PCIe host bridge (also pcie.0, bus 00),
# so every BDF above is the same; the IOMMU is the machine's SMMUv3.

# vm_machine_args_arm64 IOMMU MEM -- print the qemu-system-aarch64 command
# line up to the devices, one word per line: the virt machine under TCG with
# an emulated SMMUv3 (IOMMU 1) or none (0), a Cortex-A57 (-cpu max would
# also emulate pointer authentication, which is slow under TCG), and the
# same console and reset handling as on x86. The interrupt controller is a
# GICv3 with its ITS, as on arm64 servers: the ITS isolates MSIs, without
# which vfio_iommu_type1 and iommufd refuse a VMM the device (EPERM; the
# machine's default GICv2 with its v2m MSI frame does not isolate them).
vm_machine_args_arm64() {
    local machine=virt,accel=tcg,gic-version=3
    [[ "$1" == 1 ]] && machine+=",iommu=smmuv3"
    printf '%s\n' qemu-system-aarch64 -machine "$machine" -cpu cortex-a57 -m "$2" -smp 1 \
        -nodefaults -no-user-config -display none -serial stdio -no-reboot
}

# vm_device_args IOMMU [ARCH [KERNEL]] -- print the QEMU device options, one per line.
# IOMMU is 1 for an emulated IOMMU or 0 for no IOMMU at all. ARCH (x86_64,
# the default, or aarch64) selects how: an intel-iommu device on x86; on
# aarch64 the SMMUv3 is part of the machine (vm_machine_args_arm64). KERNEL
# iommufd adds VIRTIO_NIC behind a fifth root port.
vm_device_args() {
    local iommu="$1" arch="${2:-x86_64}" kernel="${3:-}"
    if [[ "$iommu" == 1 && "$arch" == x86_64 ]]; then
        # Must come before the PCI devices it translates for.
        printf '%s\n' -device intel-iommu,intremap=on
    fi
    printf '%s\n' \
        -device pcie-root-port,id=rp_card,bus=pcie.0,addr=0x4,chassis=1,slot=1 \
        -device e1000e,id=card_fn0,bus=rp_card,addr=0.0,multifunction=on,mac=52:54:00:00:01:00 \
        -device e1000e,id=card_fn1,bus=rp_card,addr=0.1,mac=52:54:00:00:01:01 \
        -device pcie-root-port,id=rp_solo,bus=pcie.0,addr=0x5,chassis=2,slot=2 \
        -device e1000e,id=solo_nic,bus=rp_solo,addr=0.0,mac=52:54:00:00:02:00 \
        -device pcie-root-port,id=rp_nvme,bus=pcie.0,addr=0x6,chassis=3,slot=3 \
        -device nvme-subsys,id=nvme_subsys,nqn=testbed-subsys \
        -device nvme,id=nvme_pf,bus=rp_nvme,addr=0.0,serial=TESTBED0001,subsys=nvme_subsys,sriov_max_vfs=2,sriov_vq_flexible=4,sriov_vi_flexible=2,max_ioqpairs=6,msix_qsize=4 \
        -blockdev null-co,node-name=nvme_ns1,size=67108864,read-zeroes=on \
        -device nvme-ns,bus=nvme_pf,drive=nvme_ns1,nsid=1 \
        -device pcie-root-port,id=rp_gpu,bus=pcie.0,addr=0x7,chassis=4,slot=4 \
        -device virtio-rng-pci,id=gpu_fn0,bus=rp_gpu,addr=0.0,multifunction=on \
        -device ich9-intel-hda,id=gpu_audio,bus=rp_gpu,addr=0.1
    if [[ "$kernel" == iommufd ]]; then
        printf '%s\n' \
            -device pcie-root-port,id=rp_virtio,bus=pcie.0,addr=0x8,chassis=5,slot=5 \
            -device virtio-net-pci,id=virtio_nic,bus=rp_virtio,addr=0.0,disable-legacy=on,mac=52:54:00:00:05:00
    fi
}
