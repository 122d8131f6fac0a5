//! The driver's names for what it handles, which every other module uses and
//! which uses none of them: the driver's default name, the ResourceSlice name of
//! a PCI function, the claim a record in the state file stands for, and why a
//! device should get no new claim (its taint's value).

use kubelet_plugin::ClaimRef;
use passthrough::state::ClaimRecord;
use sysfs_pci::PciAddress;

/// The driver name when `--driver-name` is not given.
pub const DEFAULT_DRIVER_NAME: &str = "vfio-sandbox.rebellions.ai";

/// The ResourceSlice device name of a PCI function: a DNS label derived from its
/// address, `0000:01:00.0` → `pci-0000-01-00-0`.
pub fn device_name(address: &PciAddress) -> String {
    let s = address.to_string().replace([':', '.'], "-");
    format!("pci-{s}")
}

/// The PCI address a [`device_name`] stands for, if it is one.
pub fn parse_device_name(name: &str) -> Option<PciAddress> {
    let rest = name.strip_prefix("pci-")?;
    let parts: Vec<&str> = rest.split('-').collect();
    let [domain, bus, dev, func] = parts.as_slice() else {
        return None;
    };
    let text = format!("{domain}:{bus}:{dev}.{func}");
    let address: PciAddress = text.parse().ok()?;
    (device_name(&address) == name).then_some(address)
}

/// The claim `uid` as its record names it.
pub fn recorded_claim(uid: &str, record: &ClaimRecord) -> ClaimRef {
    ClaimRef {
        uid: uid.to_owned(),
        namespace: record.namespace.clone(),
        name: record.name.clone(),
    }
}

/// Why a device is unhealthy, in one word: the values of its slice taint.
pub mod reason {
    /// Gone from the PCI bus.
    pub const GONE: &str = "Gone";
    /// Its sysfs attributes cannot be read.
    pub const UNREADABLE: &str = "Unreadable";
    /// A fatal PCIe error since the driver started.
    pub const FATAL_PCIE_ERROR: &str = "FatalPCIeError";
    /// Prepared, but not on its vfio driver.
    pub const NOT_ON_VFIO: &str = "NotOnVfioDriver";
    /// Prepared, but its IOMMU group is not viable or its group node is gone.
    pub const GROUP_NOT_USABLE: &str = "GroupNotUsable";
    /// It cannot be prepared (no IOMMU group, a member with VFs enabled).
    pub const UNPREPARABLE: &str = "Unpreparable";
    /// A sysfs write to it has not returned (its driver is stuck in the kernel).
    pub const STUCK: &str = "StuckInKernel";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip_and_reject_other_spellings() {
        let a: PciAddress = "0000:01:00.1".parse().expect("address");
        assert_eq!(device_name(&a), "pci-0000-01-00-1");
        assert_eq!(parse_device_name("pci-0000-01-00-1"), Some(a));
        for bad in [
            "",
            "pci-",
            "pci-01-00-1",
            "gpu-0000-01-00-1",
            "pci-0000-01-00-1-2",
            "pci-0000-0A-00-1",
            "pci-0000-01-00-9",
        ] {
            assert_eq!(parse_device_name(bad), None, "{bad}");
        }
    }
}
