//! Passthrough per ResourceClaim, for the DRA driver: the types the kubelet API, the
//! API server and the engine share.

use crate::PciAddress;

/// A claim as kubelet names it in `NodePrepareResources`.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ClaimRef {
    /// The claim's UID.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// One device the scheduler allocated to a claim, for this driver on this node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Allocation {
    /// The request(s) of the claim this device satisfies.
    pub request_names: Vec<String>,
    /// The pool (the node's name).
    pub pool: String,
    /// The device's name in the ResourceSlice ([`device_name`]).
    pub device: String,
}

/// What prepare gives back for one device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreparedDevice {
    /// The request(s) it satisfies.
    pub request_names: Vec<String>,
    /// Its pool.
    pub pool_name: String,
    /// Its name in the ResourceSlice.
    pub device_name: String,
    /// The fully qualified CDI device ids the container runtime applies.
    pub cdi_device_ids: Vec<String>,
}

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
