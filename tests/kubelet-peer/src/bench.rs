//! The benchmarks' fake node: N NVIDIA GPUs on vfio-pci, shared by `plugin-bench`
//! (the device plugin) and `dra-health-bench` (the DRA driver).

use std::path::Path;

use sysfs_pci::testing::{FakeDevice, FakeNode};
use sysfs_pci::PciAddress;

/// Device `i`: 4 functions in each of 8 slots per bus, buses from 0x10 (up to 7,680 devices).
pub fn addr(i: usize) -> PciAddress {
    let bus = u8::try_from(0x10 + i / 32).unwrap_or_else(|_| panic!("too many devices: {i}"));
    PciAddress::new(0, bus, ((i / 4) % 8) as u8, (i % 4) as u8)
        .unwrap_or_else(|| panic!("address {i}"))
}

/// NVIDIA H100 PCIe (3D controller), as the PCI ID database names it.
pub const GPU: (u16, u16, u32) = (0x10de, 0x2331, 0x03_0200);

/// IOMMU group of device `i`.
pub fn group(i: usize) -> u32 {
    100 + i as u32
}

/// `n` GPUs on vfio-pci, each alone in group [`group`], behind 8 bridges, NUMA 0/1.
pub fn gpu_node(root: &Path, n: usize) -> FakeNode {
    let node = FakeNode::new(root);
    node.add_driver("vfio-pci");
    node.add_driver("e1000e");
    for b in 0..8u8 {
        let bridge = format!("0000:00:{:02x}.0", b + 1);
        node.add_device(&FakeDevice::new(&bridge, 0x8086, 0x2922, 0x06_0400).driver("pcieport"));
    }
    for i in 0..n {
        let a = addr(i);
        let bridge = format!("0000:00:{:02x}.0", (i % 8) + 1);
        node.add_device(
            &FakeDevice::new(&a.to_string(), GPU.0, GPU.1, GPU.2)
                .driver("vfio-pci")
                .group(group(i))
                .numa((i % 2) as i32)
                .parent(&bridge),
        );
    }
    node
}
