//! What the resource list selects on this node: each selected device with its
//! resource and target driver, and every other member of its IOMMU group (a
//! "companion", such as a GPU's audio function) that must move with it.
//!
//! All three binaries build their view from [`Inventory::scan`], so "what is bound",
//! "what is validated" and "what is advertised" cannot drift apart.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::{DriverRule, ResourceList, ResourceName};
use support::error_chain;
use support::io::IoError;
use sysfs_pci::attribute::read_attribute;
use sysfs_pci::device::{
    iommu_group_of, list_addresses, parse_hex, Detail, DeviceError, PciDevice,
};
use sysfs_pci::group::{judge, Viability};
use sysfs_pci::{Host, PciAddress};

mod auto;
use auto::AutoResolver;
pub use auto::DriverChoice;

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
    /// How `"driver": "auto"` chose `target_driver`; `None` for a named driver.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_choice: Option<DriverChoice>,
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

/// Why a device was left out of the inventory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum SkipReason {
    /// Its own sysfs attributes could not be read or parsed.
    Unreadable {
        /// The error, with the file and what was found in it.
        error: String,
    },
    /// It was read, but another member of its IOMMU group could not be: a group is
    /// only bound, validated or advertised when every member is known.
    GroupMemberUnreadable {
        /// The member that could not be read (itself listed as skipped).
        member: PciAddress,
    },
}

/// A device the scan left out, and why. Skipping one device keeps the rest of the
/// node usable; callers report each one.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    /// The device.
    #[serde(rename = "bdf")]
    pub address: PciAddress,
    /// Its IOMMU group, when that much could be read.
    pub group: Option<u32>,
    /// The resource it is selected as, when it was read well enough to know.
    pub resource: Option<ResourceName>,
    /// Why it was left out.
    #[serde(flatten)]
    pub reason: SkipReason,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.reason {
            SkipReason::Unreadable { error } => write!(f, "{}: {error}", self.address),
            SkipReason::GroupMemberUnreadable { member } => write!(
                f,
                "{}: IOMMU group {} has a member that could not be read ({member}); \
                 the group is left alone",
                self.address,
                self.group.map_or_else(|| "?".to_owned(), |g| g.to_string()),
            ),
        }
    }
}

/// The selected devices, their companions, and the viability of their groups.
///
/// Invariant: every member of every group in `groups` was read. A device that could
/// not be read is in `skipped`, and so is every device of its group, which is then
/// absent from `entries` and `groups`: nothing binds, validates or advertises a
/// group with a member we know nothing about.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Inventory {
    /// Selected devices and companions, sorted by address.
    pub entries: Vec<Entry>,
    /// Viability of every group that holds a selected device.
    pub groups: BTreeMap<u32, Viability>,
    /// Devices left out, sorted by address: devices whose `vendor` cannot be read,
    /// unreadable devices of a selected vendor or of a selected device's group, and
    /// the devices of such a group.
    pub skipped: Vec<Skipped>,
}

/// The device's name from the PCI ID database (`vendor device`), if known.
pub fn product_name(vendor: u16, device: u16) -> Option<String> {
    let dev = pci_ids::Device::from_vid_pid(vendor, device)?;
    Some(format!("{} {}", dev.vendor().name(), dev.name()))
}

impl Inventory {
    /// Scans `host` for devices `list` selects, then adds their group companions,
    /// reading every attribute of each (what binding needs).
    ///
    /// Only a failure to list the PCI devices fails the scan; a malformed device is
    /// skipped and reported in [`Inventory::skipped`].
    pub fn scan(host: &Host, list: &ResourceList) -> Result<Self, DeviceError> {
        Self::scan_with(host, list, Detail::Full)
    }

    /// [`Self::scan`], reading each device as far as `detail` says.
    pub fn scan_with(
        host: &Host,
        list: &ResourceList,
        detail: Detail,
    ) -> Result<Self, DeviceError> {
        Ok(Self::scan_addresses(
            host,
            list,
            &list_addresses(host)?,
            detail,
        ))
    }

    /// [`Self::scan_addresses`] over `addresses` and every other function of
    /// their IOMMU groups, each judged by `list` as a whole scan would judge it
    /// (a selected member is selected, not a companion). For a job on a few
    /// devices: what it needs of the node, read fresh, and nothing else.
    pub fn scan_groups_of(
        host: &Host,
        list: &ResourceList,
        addresses: &[PciAddress],
        detail: Detail,
    ) -> Self {
        let mut all: BTreeSet<PciAddress> = addresses.iter().copied().collect();
        for a in addresses {
            // An unreadable group is read again, and reported, with the device.
            if let Ok(Some(group)) = sysfs_pci::device::iommu_group_of(host, a) {
                all.extend(sysfs_pci::group::members(host, group).unwrap_or_default());
            }
        }
        let all: Vec<PciAddress> = all.into_iter().collect();
        Self::scan_addresses(host, list, &all, detail)
    }

    /// [`Self::scan_with`] over `addresses` only: the devices among them that `list`
    /// selects, with the whole IOMMU group of each (members outside `addresses`
    /// included). For following a few devices without reading the whole node.
    pub fn scan_addresses(
        host: &Host,
        list: &ResourceList,
        addresses: &[PciAddress],
        detail: Detail,
    ) -> Self {
        let vendors = list.vendors();
        let mut auto = AutoResolver::new(host);
        let mut selected = Vec::new();
        let mut skipped = Vec::new();
        for &address in addresses {
            // Read one small file first: most devices on a node are not ours.
            let vendor_path = host.device_dir(&address).join("vendor");
            let vendor = match read_attribute(&vendor_path) {
                Ok(text) => parse_hex(&text).and_then(|v| u16::try_from(v).ok()),
                // Removed while we were listing.
                Err(e) if e.is_gone() => continue,
                Err(e) => {
                    skipped.push(unreadable(host, address, &e.into()));
                    continue;
                }
            };
            let Some(vendor) = vendor.filter(|v| vendors.contains(v)) else {
                continue;
            };
            let device = match PciDevice::read_known(host, &address, detail, Some(vendor)) {
                Ok(d) => d,
                Err(e) if e.is_gone() => continue,
                Err(e) => {
                    skipped.push(unreadable(host, address, &e));
                    continue;
                }
            };
            if let Some(sel) = list.select(&device.address, &device.ids()) {
                if device.is_bridge() {
                    continue;
                }
                // The one place a selected device's driver is decided: `auto` becomes
                // a concrete driver here, so binding and restoring never see it.
                let (target_driver, driver_choice) = match sel.driver {
                    DriverRule::Named(name) => (name, None),
                    DriverRule::Auto => {
                        let choice = auto.choose(&device);
                        tracing::debug!(bdf = %device.address, choice = %choice, "driver auto");
                        (choice.driver.clone(), Some(choice))
                    }
                };
                selected.push(Entry {
                    device,
                    role: Role::Selected {
                        resource: sel.resource,
                    },
                    target_driver,
                    driver_choice,
                });
            }
        }
        let mut inv = Self::with_companions(host, selected, skipped, detail);
        inv.skipped.sort_by_key(|s| s.address);
        inv.skipped.dedup_by_key(|s| s.address);
        inv
    }

    fn with_companions(
        host: &Host,
        selected: Vec<Entry>,
        skipped: Vec<Skipped>,
        detail: Detail,
    ) -> Self {
        let mut entries: BTreeMap<PciAddress, Entry> = selected
            .into_iter()
            .map(|e| (e.device.address, e))
            .collect();
        let mut inv = Self {
            skipped,
            ..Self::default()
        };
        let owners: Vec<(u32, PciAddress)> = entries
            .values()
            .filter_map(|e| Some((e.device.iommu_group?, e.device.address)))
            .collect();
        for (group, owner) in owners {
            if inv.groups.contains_key(&group) || !entries.contains_key(&owner) {
                continue; // judged already, or held back with its group
            }
            let (members, bad) = match read_group(host, group, &entries, detail) {
                Ok(read) => read,
                Err(e) => {
                    let error = format!("IOMMU group {group}: {}", error_chain(&e));
                    inv.hold_back(&mut entries, group, SkipReason::Unreadable { error });
                    continue;
                }
            };
            if let Some(member) = bad.first().map(|b| b.address) {
                inv.hold_back(
                    &mut entries,
                    group,
                    SkipReason::GroupMemberUnreadable { member },
                );
                inv.skipped.extend(bad);
                continue;
            }
            inv.groups.insert(group, judge(group, &members));
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
                        driver_choice: None,
                        device: m,
                        role,
                    },
                );
            }
        }
        inv.entries = entries.into_values().collect();
        inv
    }

    /// Moves every entry of `group` to `skipped`, for `reason`.
    fn hold_back(
        &mut self,
        entries: &mut BTreeMap<PciAddress, Entry>,
        group: u32,
        reason: SkipReason,
    ) {
        let held: Vec<PciAddress> = entries
            .values()
            .filter(|e| e.device.iommu_group == Some(group))
            .map(|e| e.device.address)
            .collect();
        for address in held {
            if let Some(e) = entries.remove(&address) {
                self.skipped.push(Skipped {
                    address,
                    group: Some(group),
                    resource: e.resource().cloned(),
                    reason: reason.clone(),
                });
            }
        }
    }

    /// Why a device bound in `group` cannot be used by a VM now, or `None`: no
    /// group at all, a member on a driver that makes the group not viable, or the
    /// group's `/dev/vfio/<group>` node missing. The device plugin's health and the
    /// DRA driver's say the same.
    pub fn group_problem(&self, host: &Host, group: Option<u32>) -> Option<String> {
        let Some(group) = group else {
            return Some("no IOMMU group".into());
        };
        if let Some(v) = self.groups.get(&group) {
            if let Some(b) = v.blockers.first() {
                return Some(format!(
                    "IOMMU group {group} is not viable: {} is on {}",
                    b.address, b.driver
                ));
            }
        }
        let node = host.vfio_group_node(group);
        (!Host::exists(&node)).then(|| format!("{} is missing", node.display()))
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

    /// The skipped record for `address`, if the scan left it out.
    pub fn skipped(&self, address: &PciAddress) -> Option<&Skipped> {
        self.skipped.iter().find(|s| s.address == *address)
    }

    /// Entries in IOMMU group `group` (selected and companions).
    pub fn in_group(&self, group: u32) -> impl Iterator<Item = &Entry> {
        self.entries
            .iter()
            .filter(move |e| e.device.iommu_group == Some(group))
    }
}

/// Which skipped devices a long-running caller has already reported, so that each is
/// reported once per reason rather than on every rescan. A device that can be read
/// again is forgotten, and reported anew if it breaks again.
#[derive(Debug, Default)]
pub struct SkipLog {
    reported: BTreeMap<PciAddress, String>,
}

/// What changed since the last [`SkipLog::note`].
#[derive(Debug, Default)]
pub struct SkipNews<'a> {
    /// Skipped devices not reported yet, or whose reason changed.
    pub new: Vec<&'a Skipped>,
    /// Devices reported before that are no longer skipped.
    pub recovered: Vec<PciAddress>,
}

impl SkipLog {
    /// Takes the skipped devices of a fresh scan; returns what to report.
    pub fn note<'a>(&mut self, skipped: &'a [Skipped]) -> SkipNews<'a> {
        self.note_within(skipped, |_| true)
    }

    /// [`Self::note`] for a scan of some devices only: `scanned` says which addresses
    /// the scan covered; what was reported of the others is kept.
    pub fn note_within<'a>(
        &mut self,
        skipped: &'a [Skipped],
        scanned: impl Fn(&PciAddress) -> bool,
    ) -> SkipNews<'a> {
        let mut news = SkipNews::default();
        let mut reported: BTreeMap<PciAddress, String> = self
            .reported
            .iter()
            .filter(|(a, _)| !scanned(a))
            .map(|(a, m)| (*a, m.clone()))
            .collect();
        for s in skipped {
            let message = s.to_string();
            if self.reported.get(&s.address) != Some(&message) {
                news.new.push(s);
            }
            reported.insert(s.address, message);
        }
        news.recovered = self
            .reported
            .keys()
            .filter(|a| !reported.contains_key(a))
            .copied()
            .collect();
        self.reported = reported;
        news
    }

    /// True when no skipped device is remembered.
    pub fn is_empty(&self) -> bool {
        self.reported.is_empty()
    }
}

/// Reads every member of `group`, taking already-read devices from `known`. Returns the
/// members read and a skipped record per member that could not be; an error when the
/// member list itself cannot be read.
fn read_group(
    host: &Host,
    group: u32,
    known: &BTreeMap<PciAddress, Entry>,
    detail: Detail,
) -> Result<(Vec<PciDevice>, Vec<Skipped>), IoError> {
    let mut members = Vec::new();
    let mut bad = Vec::new();
    for address in sysfs_pci::group::members(host, group)? {
        match known.get(&address) {
            Some(e) => members.push(e.device.clone()),
            None => match PciDevice::read_with(host, &address, detail) {
                Ok(d) => members.push(d),
                Err(e) if e.is_gone() => {}
                Err(e) => bad.push(Skipped {
                    group: Some(group),
                    ..unreadable(host, address, &e)
                }),
            },
        }
    }
    Ok((members, bad))
}

/// The record of a device whose attributes could not be read.
fn unreadable(host: &Host, address: PciAddress, error: &DeviceError) -> Skipped {
    tracing::debug!(bdf = %address, error = %error_chain(error),
        "skipping a device that cannot be read");
    Skipped {
        address,
        group: iommu_group_of(host, &address).ok().flatten(),
        resource: None,
        reason: SkipReason::Unreadable {
            error: error_chain(error),
        },
    }
}

#[cfg(test)]
mod tests;
