//! IOMMU groups: membership, viability and the in-use probe.
//!
//! A group can be handed to a VM only when every member that is not a bridge is on a
//! vfio driver, on `pci-stub`, or has no driver ("viable").

use crate::device::{DeviceError, PciDevice};
use crate::vfio_driver::is_vfio_driver;
use crate::{Host, PciAddress};
use support::io::{Action, IoError, WrapIo};

/// The drivers that keep a group viable besides vfio drivers.
pub const STUB_DRIVER: &str = "pci-stub";

/// The members of IOMMU group `group`, sorted; empty when the group is gone (its last
/// device was removed).
pub fn members(host: &Host, group: u32) -> Result<Vec<PciAddress>, IoError> {
    let dir = host.iommu_group_devices_dir(group);
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(IoError::new(Action::List, &dir, e)),
    };
    for entry in entries {
        let entry = entry.wrap(Action::List, &dir)?;
        if let Some(addr) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
            out.push(addr);
        }
    }
    out.sort();
    Ok(out)
}

/// True when the kernel has IOMMU groups (the IOMMU is on and translating).
pub fn iommu_enabled(host: &Host) -> bool {
    std::fs::read_dir(host.iommu_groups_dir()).is_ok_and(|mut d| d.next().is_some())
}

/// A member that makes its group unusable for a VM.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Blocker {
    /// The member.
    pub address: PciAddress,
    /// The driver it is on.
    pub driver: String,
}

/// Why a group is (not) viable.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Viability {
    /// The group number.
    pub group: u32,
    /// Members on a non-vfio driver, empty when viable.
    pub blockers: Vec<Blocker>,
}

impl Viability {
    /// True when a VM can take the group.
    pub fn is_viable(&self) -> bool {
        self.blockers.is_empty()
    }
}

/// Judges a group from its members' snapshots.
pub fn judge(group: u32, members: &[PciDevice]) -> Viability {
    let blockers = members
        .iter()
        .filter(|m| !m.is_bridge())
        .filter_map(|m| {
            let d = m.driver.as_deref()?;
            (!is_vfio_driver(d) && d != STUB_DRIVER).then(|| Blocker {
                address: m.address,
                driver: d.to_owned(),
            })
        })
        .collect();
    Viability { group, blockers }
}

/// Reads every member of `group` and judges it.
pub fn viability(host: &Host, group: u32) -> Result<Viability, DeviceError> {
    let devices = read_members(host, group)?;
    Ok(judge(group, &devices))
}

/// Reads every member of `group`, leaving out members that vanish meanwhile.
pub fn read_members(host: &Host, group: u32) -> Result<Vec<PciDevice>, DeviceError> {
    let mut out = Vec::new();
    for address in members(host, group)? {
        match PciDevice::read(host, &address) {
            Ok(d) => out.push(d),
            Err(e) if e.is_gone() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}
