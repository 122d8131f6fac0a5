//! Rebellions' own DRA vocabulary, spoken beside ours for the devices the
//! `rebellions` preset names under `"naming": "pci-ids"`, so that a claim written for
//! Rebellions' DRA driver selects them unchanged.
//!
//! Rebellions' driver is `npu.rebellions.ai` (RBLN-SW/rbln-k8s-dra-driver,
//! `pkg/consts/consts.go`; the `driverName` of its Helm chart,
//! `deployments/helm/k8s-dra-driver-npu/templates/_helpers.tpl`). Its kubelet plugin
//! publishes each Rebellions NPU on `vfio-pci` as a device `vfio-<address>`
//! (`cmd/npu-kubelet-plugin/vfio.go`, `enumerateVfioDevices`; the keys in
//! `cmd/npu-kubelet-plugin/state.go`) with:
//!
//! | attribute | type | value |
//! |---|---|---|
//! | `type` | string | `vfio` (its container devices say `npu`) |
//! | `iommuGroup` | int | the IOMMU group |
//! | `pciDeviceID` | string | the device id, 4 lower-case hex digits without `0x` (`1220`) |
//! | `productName` | string | `RBLN-CA22` for `1220`/`1221`, `RBLN-CA25` for `1250`/`1251` |
//! | `vf` | bool | whether the function is an SR-IOV VF (it has a `physfn` link) |
//! | `resource.kubernetes.io/pciBusID` | string | the address |
//! | `resource.kubernetes.io/pcieRoot` | string | `pci<domain>:<bus>` |
//! | `resource.kubernetes.io/numaNode` | int | the NUMA node, absent when sysfs says `-1` |
//! | `dra.net/numaNode` | int | the same, for alignment with DraNet's NICs |
//!
//! Its unqualified names are in its own domain, so its CEL reads
//! `device.attributes["npu.rebellions.ai"].productName`: we publish those qualified
//! with `npu.rebellions.ai/`. The two standard ones we publish anyway ([`PCI_BUS_ID`],
//! [`PCIE_ROOT`]). Where Rebellions names only the CA22 and CA25, we name every
//! device, by the rule that names its resource (`rebellions.ai/RBLN-CA22_PF` →
//! `RBLN-CA22`): [`passthrough::config::ResourceList::rebellions_product`]. The
//! device keeps our name (`pci-0000-3b-00-0`): nothing of Rebellions' selects on
//! device names, and KubeVirt reads the address from the metadata file.
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
