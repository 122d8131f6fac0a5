//! Rebellions' own DRA vocabulary, spoken beside ours for the devices the
//! `rebellions` preset names under `"naming": "pci-ids"`, so that a claim written for
//! Rebellions' DRA driver selects them unchanged; the attributes, with their types
//! and values, are tabled in docs/sandbox-dra-driver.md ("Rebellions' DRA
//! vocabulary").
//!
//! Transcribed from RBLN-SW/rbln-k8s-dra-driver: the driver name from
//! `pkg/consts/consts.go` and its chart's `_helpers.tpl`, the attributes from
//! `cmd/npu-kubelet-plugin/vfio.go` (`enumerateVfioDevices`) and the keys in
//! `cmd/npu-kubelet-plugin/state.go`. Its unqualified names are in its own domain,
//! so we qualify them with `npu.rebellions.ai/`; the two standard ones
//! ([`PCI_BUS_ID`], [`PCIE_ROOT`]) we publish anyway. Every device gets a
//! `productName`, by the rule that names its resource
//! ([`passthrough::config::ResourceList::rebellions_product`]), and keeps our name.
//!
//! [`PCI_BUS_ID`]: kubelet_plugin::PCI_BUS_ID
//! [`PCIE_ROOT`]: kubelet_plugin::PCIE_ROOT

use k8s_openapi::api::resource::v1::DeviceAttribute;
use sysfs_pci::PciDevice;

/// Rebellions' driver name, the domain of its own attributes.
pub const DOMAIN: &str = "npu.rebellions.ai";

/// The value of its `type` attribute for a passthrough device.
pub const TYPE_VFIO: &str = "vfio";

/// The standard NUMA attribute Rebellions' driver publishes.
const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";

/// The NUMA attribute of DraNet (and dra-driver-cpu), which Rebellions' driver
/// mirrors so one claim can align an NPU with a NIC or CPUs.
const DRANET_NUMA_NODE: &str = "dra.net/numaNode";

fn qualified(name: &str) -> String {
    format!("{DOMAIN}/{name}")
}

/// The attributes Rebellions' driver would publish for `dev`, a device of product
/// `product`, beside the standard ones every device of ours carries.
pub fn attributes(dev: &PciDevice, product: &str) -> Vec<(String, DeviceAttribute)> {
    let string = |s: String| DeviceAttribute {
        string: Some(s),
        ..DeviceAttribute::default()
    };
    let int = |i: u32| DeviceAttribute {
        int: Some(i64::from(i)),
        ..DeviceAttribute::default()
    };
    let mut out = vec![
        (qualified("type"), string(TYPE_VFIO.to_owned())),
        (
            qualified("pciDeviceID"),
            string(format!("{:04x}", dev.device)),
        ),
        (qualified("productName"), string(product.to_owned())),
        (
            qualified("vf"),
            DeviceAttribute {
                bool: Some(dev.physfn.is_some()),
                ..DeviceAttribute::default()
            },
        ),
    ];
    if let Some(group) = dev.iommu_group {
        out.push((qualified("iommuGroup"), int(group)));
    }
    if let Some(numa) = dev.numa_node {
        out.push((NUMA_NODE.to_owned(), int(numa)));
        out.push((DRANET_NUMA_NODE.to_owned(), int(numa)));
    }
    out
}
