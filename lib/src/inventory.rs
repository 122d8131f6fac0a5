//! What the resource list selects on this node: each selected device with its
//! resource and target driver, and every other member of its IOMMU group (a
//! "companion", such as a GPU's audio function) that must move with it.
//!
//! All three binaries build their view from [`Inventory::scan`], so "what is bound",
//! "what is validated" and "what is advertised" cannot drift apart.

use std::collections::BTreeMap;

use crate::config::{ResourceList, ResourceName};
use crate::device::{list_addresses, parse_hex, DeviceError, PciDevice};
use crate::group::{judge, Viability};
use crate::io::read_trimmed;
use crate::{Host, PciAddress};

/// Driver that group companions are moved to.
pub const COMPANION_DRIVER: &str = "vfio-pci";

/// Why a device is in the inventory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Role {
    /// Selected by the resource list, advertised as `resource`.
    Selected {
        /// The extended resource name.
        resource: ResourceName,
    },
    /// Shares an IOMMU group with the selected device `of`.
    Companion {
        /// The selected device it travels with.
        of: PciAddress,
    },
    /// A PCI bridge in a selected device's group: never moved.
    Bridge,
}

/// One device of the inventory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Entry {
    /// The device as read.
    pub device: PciDevice,
    /// Why it is here.
    pub role: Role,
    /// The driver it should be on.
    pub target_driver: String,
}

impl Entry {
    /// True when the device is on its target driver.
    pub fn is_bound(&self) -> bool {
        matches!(self.role, Role::Bridge)
            || self.device.driver.as_deref() == Some(self.target_driver.as_str())
    }

    /// The resource name, for selected devices.
    pub fn resource(&self) -> Option<&ResourceName> {
        match &self.role {
            Role::Selected { resource } => Some(resource),
            _ => None,
        }
    }
}

/// The selected devices, their companions, and the viability of their groups.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Inventory {
    /// Selected devices and companions, sorted by address.
    pub entries: Vec<Entry>,
    /// Viability of every group that holds a selected device.
    pub groups: BTreeMap<u32, Viability>,
}

/// The device's name from the PCI ID database (`vendor device`), if known.
pub fn device_name(vendor: u16, device: u16) -> Option<String> {
    let dev = pci_ids::Device::from_vid_pid(vendor, device)?;
    Some(format!("{} {}", dev.vendor().name(), dev.name()))
}

impl Inventory {
    /// Scans `host` for devices `list` selects, then adds their group companions.
    pub fn scan(host: &Host, list: &ResourceList) -> Result<Self, DeviceError> {
        let vendors = list.vendors();
        let mut selected = Vec::new();
        for address in list_addresses(host)? {
            // Read one small file first: most devices on a node are not ours.
            let vendor_path = host.device_dir(&address).join("vendor");
            let vendor = match read_trimmed(&vendor_path) {
                Ok(text) => parse_hex(&text),
                // Removed while we were listing.
                Err(e) if e.is_gone() => continue,
                Err(e) => return Err(e.into()),
            };
            if !vendor.is_some_and(|v| vendors.iter().any(|x| u32::from(*x) == v)) {
                continue;
            }
            let device = match PciDevice::read(host, &address) {
                Ok(d) => d,
                Err(e) if e.is_gone() => continue,
                Err(e) => return Err(e),
            };
            if let Some(sel) = list.select(&device.ids()) {
                if device.is_bridge() {
                    continue;
                }
                selected.push(Entry {
                    device,
                    role: Role::Selected {
                        resource: sel.resource,
                    },
                    target_driver: sel.driver,
                });
            }
        }
        Self::with_companions(host, selected)
    }

    fn with_companions(host: &Host, selected: Vec<Entry>) -> Result<Self, DeviceError> {
        let mut entries: BTreeMap<PciAddress, Entry> = selected
            .into_iter()
            .map(|e| (e.device.address, e))
            .collect();
        let mut groups = BTreeMap::new();
        let owners: Vec<(u32, PciAddress)> = entries
            .values()
            .filter_map(|e| Some((e.device.iommu_group?, e.device.address)))
            .collect();
        for (group, owner) in owners {
            if groups.contains_key(&group) {
                continue;
            }
            // Members already read as selected devices are not read again.
            let mut members = Vec::new();
            for address in crate::group::members(host, group)? {
                match entries.get(&address) {
                    Some(e) => members.push(e.device.clone()),
                    None => match PciDevice::read(host, &address) {
                        Ok(d) => members.push(d),
                        Err(e) if e.is_gone() => {}
                        Err(e) => return Err(e),
                    },
                }
            }
            groups.insert(group, judge(group, &members));
            for m in members {
                if entries.contains_key(&m.address) {
                    continue;
                }
                let role = if m.is_bridge() {
                    Role::Bridge
                } else {
                    Role::Companion { of: owner }
                };
                let target_driver = m.driver.clone().filter(|_| m.is_bridge());
                entries.insert(
                    m.address,
                    Entry {
                        target_driver: target_driver.unwrap_or_else(|| COMPANION_DRIVER.into()),
                        device: m,
                        role,
                    },
                );
            }
        }
        Ok(Self {
            entries: entries.into_values().collect(),
            groups,
        })
    }

    /// The entry for `address`.
    pub fn get(&self, address: &PciAddress) -> Option<&Entry> {
        self.entries.iter().find(|e| e.device.address == *address)
    }

    /// Selected devices only.
    pub fn selected(&self) -> impl Iterator<Item = &Entry> {
        self.entries
            .iter()
            .filter(|e| matches!(e.role, Role::Selected { .. }))
    }

    /// Entries in IOMMU group `group` (selected and companions).
    pub fn in_group(&self, group: u32) -> impl Iterator<Item = &Entry> {
        self.entries
            .iter()
            .filter(move |e| e.device.iommu_group == Some(group))
    }
}
