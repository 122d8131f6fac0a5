//! The driver's names for what it handles, which every other module uses and
//! which uses none of them: the driver's default name, the ResourceSlice name of
//! a PCI function, its claims' records in the state file, and why a device should
//! get no new claim (its taint's value).

use std::collections::BTreeMap;

use kubelet_plugin::ClaimRef;
use passthrough::state::Records;
use sysfs_pci::PciAddress;

/// The driver's state file: the engine's record of moved devices, and the claims.
pub type StateFile = passthrough::state::StateFile<ClaimRecords>;

/// Where a claim is in its life; saved before each step, so a restart knows what to
/// finish or undo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimPhase {
    /// Prepare has started: its devices may be partly moved. A restart rolls it back.
    /// An early move (the claim allocated, its pod not yet bound) starts here too.
    Preparing,
    /// Moved early: every group is on vfio, before kubelet asked (the scheduler
    /// waits on the claim's binding condition). No files yet. A restart keeps it;
    /// prepare then only writes the files, and a claim that loses its allocation
    /// gets its devices back.
    Moved,
    /// Every group is on vfio and the claim's files are written.
    Prepared,
    /// Unprepare has started. A restart finishes it.
    Unpreparing,
}

/// One device of a claim.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct ClaimDevice {
    /// The request(s) it satisfies.
    pub request_names: Vec<String>,
    pub pool: String,
    /// Its ResourceSlice device name.
    pub device: String,
    pub address: PciAddress,
    /// Its IOMMU group, which moves with it.
    pub group: u32,
    /// The other selected functions of its group, when the device is the whole
    /// group ([`group_device_name`]); `address` is the lowest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub functions: Vec<PciAddress>,
}

impl ClaimDevice {
    /// Every function it hands over: its own address, then the group's others.
    pub fn addresses(&self) -> impl Iterator<Item = PciAddress> + '_ {
        std::iter::once(self.address).chain(self.functions.iter().copied())
    }
}

/// A claim the driver holds devices for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct ClaimRecord {
    pub namespace: String,
    pub name: String,
    /// Where it is.
    pub phase: ClaimPhase,
    /// Its devices, in allocation order.
    pub devices: Vec<ClaimDevice>,
}

impl ClaimRecord {
    /// The distinct IOMMU groups of its devices, ascending.
    pub fn groups(&self) -> Vec<u32> {
        let mut groups: Vec<u32> = self.devices.iter().map(|d| d.group).collect();
        groups.sort_unstable();
        groups.dedup();
        groups
    }
}

/// The claims prepared (or being prepared, moved early or unprepared), by UID: the
/// driver's records in its state file, under `claims`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct ClaimRecords(pub BTreeMap<String, ClaimRecord>);

impl std::ops::Deref for ClaimRecords {
    type Target = BTreeMap<String, ClaimRecord>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Records for ClaimRecords {
    const KEY: &'static str = "claims";
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn devices(&self) -> Vec<PciAddress> {
        self.0
            .values()
            .flat_map(|c| c.devices.iter().flat_map(ClaimDevice::addresses))
            .collect()
    }
}

pub use claim_label::DEFAULT_DRIVER_NAME;

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

/// The ResourceSlice device name of a whole IOMMU group of several selected
/// functions, after its lowest function: `0000:01:00.0` → `group-0000-01-00-0`.
pub fn group_device_name(lowest: &PciAddress) -> String {
    let s = lowest.to_string().replace([':', '.'], "-");
    format!("group-{s}")
}

/// What a device name of ours stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceName {
    /// One function ([`device_name`]).
    Function(PciAddress),
    /// The IOMMU group of this function, whole ([`group_device_name`]).
    Group(PciAddress),
}

impl DeviceName {
    /// The function named (the lowest of a group).
    pub fn address(self) -> PciAddress {
        match self {
            Self::Function(a) | Self::Group(a) => a,
        }
    }

    /// Reads a name [`device_name`] or [`group_device_name`] made.
    pub fn parse(name: &str) -> Option<Self> {
        if let Some(a) = parse_device_name(name) {
            return Some(Self::Function(a));
        }
        let rest = name.strip_prefix("group-")?;
        let a = parse_device_name(&format!("pci-{rest}"))?;
        Some(Self::Group(a))
    }
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
    /// The node isolates no device interrupts: no VMM can take a device.
    pub const NO_INTERRUPT_ISOLATION: &str = "NoInterruptIsolation";
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
            assert_eq!(DeviceName::parse(bad), None, "{bad}");
        }
        assert_eq!(group_device_name(&a), "group-0000-01-00-1");
        assert_eq!(
            DeviceName::parse("group-0000-01-00-1"),
            Some(DeviceName::Group(a))
        );
        assert_eq!(
            DeviceName::parse("pci-0000-01-00-1"),
            Some(DeviceName::Function(a))
        );
        for bad in [
            "group-",
            "group-0000-01-00",
            "group-pci-0000-01-00-1",
            "Group-0000-01-00-1",
        ] {
            assert_eq!(DeviceName::parse(bad), None, "{bad}");
        }
    }
}
