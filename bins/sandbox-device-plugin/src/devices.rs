//! What each resource advertises, and whether each device is usable.
//!
//! A device joins its resource once it is bound to its vfio driver, and stays listed
//! from then on: unbound, removed, or in a group that lost viability, it turns
//! `Unhealthy` instead of vanishing, so kubelet stops handing it out; when it comes
//! back it turns `Healthy` again.
//!
//! A device whose sysfs attributes cannot be read is skipped by the scan (see
//! [`Inventory::skipped`]); the rest is advertised as usual, and each skipped device is
//! logged once, not on every resync. An advertised device held back that way (its
//! group gained a member we cannot read) turns `Unhealthy` with the reason.

use std::collections::{BTreeMap, BTreeSet};

use passthrough::config::{ResourceList, ResourceName};
use passthrough::inventory::{Inventory, SkipLog, Skipped};
use sysfs_pci::device::{iommu_group_of, Detail, DeviceError};
use sysfs_pci::{Host, PciAddress};

/// One advertised device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceState {
    /// Its address, which is also its device-plugin ID.
    pub address: PciAddress,
    /// IOMMU group (`/dev/vfio/<group>`).
    pub group: Option<u32>,
    /// NUMA node, when the platform reports one.
    pub numa_node: Option<u32>,
    /// The nearest upstream bridge, for packing allocations.
    pub bridge: Option<PciAddress>,
    /// The iommufd character device (`vfioN` under `vfio-dev/`), when the kernel has one.
    pub cdev: Option<String>,
    /// True when the kernel has no VFIO device cdev at all (no vfio device has a
    /// `dev` attribute): with `--iommufd` its nodes are left out, not refused.
    pub no_cdev_kernel: bool,
    /// `None` when healthy, else why not.
    pub problem: Option<String>,
}

impl DeviceState {
    /// The device-plugin ID: the BDF, as [`PciAddress`]'s `Display` writes it.
    /// Written digit by digit (every ListAndWatch message has one per device, and
    /// the formatting machinery cost more than the rest of the message).
    pub fn id(&self) -> String {
        let a = &self.address;
        let Ok(domain) = u16::try_from(a.domain()) else {
            return a.to_string(); // more than four digits: the general path
        };
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let nibble = |v: u32, shift: u32| char::from(HEX[((v >> shift) & 0xf) as usize]);
        let mut id = String::with_capacity(12);
        for shift in [12, 8, 4, 0] {
            id.push(nibble(domain.into(), shift));
        }
        id.push(':');
        id.push(nibble(a.bus().into(), 4));
        id.push(nibble(a.bus().into(), 0));
        id.push(':');
        id.push(nibble(a.slot().into(), 4));
        id.push(nibble(a.slot().into(), 0));
        id.push('.');
        id.push(nibble(a.function().into(), 0));
        id
    }

    /// True when a VM can use it now.
    pub fn healthy(&self) -> bool {
        self.problem.is_none()
    }
}

/// Every resource with its devices, sorted by address.
pub type Snapshot = BTreeMap<ResourceName, Vec<DeviceState>>;

/// One device whose state an update changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    /// The resource it is advertised under.
    pub resource: ResourceName,
    /// Its state before; `None` when it was not advertised.
    pub before: Option<DeviceState>,
    /// Its state now.
    pub after: DeviceState,
}

/// Remembers every device ever advertised, so one that goes away turns Unhealthy.
#[derive(Debug, Default)]
pub struct Tracker {
    known: BTreeMap<ResourceName, BTreeMap<PciAddress, DeviceState>>,
    /// Why no device is usable now whatever its own state: another program owns
    /// the node's devices ([`owner_problem`]).
    not_ours: Option<String>,
    /// Skipped devices already logged.
    skip_log: SkipLog,
    /// Whether to look up each device's iommufd character device.
    iommufd: bool,
}

impl Tracker {
    /// A tracker that knows no device yet; with `iommufd` it also notes each device's
    /// `vfioN` character device (Allocate hands it out).
    pub fn new(iommufd: bool) -> Self {
        Self {
            iommufd,
            ..Self::default()
        }
    }

    /// Reads the whole node and returns the new snapshot.
    pub fn rescan(&mut self, host: &Host, list: &ResourceList) -> Result<Snapshot, DeviceError> {
        self.rescan_changes(host, list)?;
        Ok(self.snapshot())
    }

    /// [`Self::refresh_changes`], then the whole snapshot.
    #[cfg(test)]
    pub fn refresh(
        &mut self,
        host: &Host,
        list: &ResourceList,
        addresses: &BTreeSet<PciAddress>,
        groups: &BTreeSet<u32>,
    ) -> Result<Snapshot, DeviceError> {
        self.refresh_changes(host, list, addresses, groups)?;
        Ok(self.snapshot())
    }

    /// Every resource with its devices, as ListAndWatch lists them: all of them
    /// Unhealthy while the node is not vfio-manager's.
    pub fn snapshot(&self) -> Snapshot {
        let mark = |d: &DeviceState| {
            let mut d = d.clone();
            if d.problem.is_none() {
                d.problem.clone_from(&self.not_ours);
            }
            d
        };
        self.known
            .iter()
            .map(|(r, m)| (r.clone(), m.values().map(mark).collect()))
            .collect()
    }

    /// Sets why no device is usable now (`None`: the node is vfio-manager's, or
    /// no program owns it); true when that changed, said once.
    pub fn set_not_ours(&mut self, why: Option<String>) -> bool {
        if self.not_ours == why {
            return false;
        }
        match &why {
            Some(w) => {
                tracing::error!(reason = %w, "every device is Unhealthy: the node's \
                    devices are not vfio-manager's")
            }
            None => tracing::info!(
                "the node's devices are vfio-manager's again: device health as the node says"
            ),
        }
        self.not_ours = why;
        true
    }

    /// Reads the whole node; returns the devices whose state changed.
    pub fn rescan_changes(
        &mut self,
        host: &Host,
        list: &ResourceList,
    ) -> Result<Vec<Changed>, DeviceError> {
        let inv = Inventory::scan_with(host, list, Detail::Brief)?;
        Ok(self.apply(host, &inv, None))
    }

    /// Reads again only what `addresses` and `groups` touch: those devices and every
    /// member of their IOMMU groups (the groups they were in and the ones they are in
    /// now), so the work follows the change, not the size of the node. Returns the
    /// devices whose state changed; every other device is left as it was.
    pub fn refresh_changes(
        &mut self,
        host: &Host,
        list: &ResourceList,
        addresses: &BTreeSet<PciAddress>,
        groups: &BTreeSet<u32>,
    ) -> Result<Vec<Changed>, DeviceError> {
        let mut groups = groups.clone();
        for address in addresses {
            groups.extend(self.known_group(address));
            if let Ok(Some(g)) = iommu_group_of(host, address) {
                groups.insert(g);
            }
        }
        let mut scope = addresses.clone();
        for &group in &groups {
            scope.extend(sysfs_pci::group::members(host, group)?);
            scope.extend(
                self.known
                    .values()
                    .flat_map(|m| m.values())
                    .filter(|d| d.group == Some(group))
                    .map(|d| d.address),
            );
        }
        let scanned: Vec<PciAddress> = scope.iter().copied().collect();
        let inv = Inventory::scan_addresses(host, list, &scanned, Detail::Brief);
        Ok(self.apply(host, &inv, Some(&scope)))
    }

    /// The group an advertised device was last seen in.
    fn known_group(&self, address: &PciAddress) -> Option<u32> {
        self.known
            .values()
            .find_map(|m| m.get(address))
            .and_then(|d| d.group)
    }

    /// Takes a scan of the devices in `scope` (every device when `None`) into the
    /// known devices, in place (a device outside the scope is not touched), and
    /// returns those whose state changed.
    fn apply(
        &mut self,
        host: &Host,
        inv: &Inventory,
        scope: Option<&BTreeSet<PciAddress>>,
    ) -> Vec<Changed> {
        let in_scope = |a: &PciAddress| scope.is_none_or(|s| s.contains(a));
        for s in self.note_skipped(&inv.skipped, in_scope) {
            tracing::warn!(bdf = %s.address, reason = %s, "not advertising a device \
                that cannot be read");
        }
        let mut seen = self.read_states(host, inv);
        // Known devices the scan covered but did not find are gone; the rest are
        // as they were.
        let covered: Vec<(&ResourceName, &DeviceState)> = match scope {
            None => self
                .known
                .iter()
                .flat_map(|(r, m)| m.values().map(move |d| (r, d)))
                .collect(),
            Some(scope) => self
                .known
                .iter()
                .flat_map(|(r, m)| scope.iter().filter_map(move |a| Some((r, m.get(a)?))))
                .collect(),
        };
        for (resource, old) in covered {
            let now = seen.entry(resource.clone()).or_default();
            now.entry(old.address).or_insert_with(|| {
                let mut kept = old.clone();
                kept.problem = Some("device removed".into());
                kept
            });
        }
        let mut changed = Vec::new();
        for (resource, devices) in seen {
            let known = self.known.entry(resource.clone()).or_default();
            for (address, state) in devices {
                if known.get(&address) == Some(&state) {
                    continue;
                }
                let before = known.insert(address, state.clone());
                changed.push(Changed {
                    resource: resource.clone(),
                    before,
                    after: state,
                });
            }
        }
        changed
    }

    /// The state of each device the scan read: the selected devices (once bound, or
    /// once advertised) and the advertised ones it had to skip.
    fn read_states(
        &self,
        host: &Host,
        inv: &Inventory,
    ) -> BTreeMap<ResourceName, BTreeMap<PciAddress, DeviceState>> {
        let mut seen: BTreeMap<ResourceName, BTreeMap<PciAddress, DeviceState>> = BTreeMap::new();
        let no_cdev_kernel =
            self.iommufd && sysfs_pci::cdev::kernel_has_vfio_cdev(host) == Some(false);
        // Advertised before, held back now: Unhealthy with the reason, not "removed".
        for s in &inv.skipped {
            let Some(resource) = &s.resource else {
                continue;
            };
            if let Some(old) = self.known.get(resource).and_then(|m| m.get(&s.address)) {
                let mut held = old.clone();
                held.problem = Some(s.to_string());
                seen.entry(resource.clone())
                    .or_default()
                    .insert(s.address, held);
            }
        }
        for entry in inv.selected() {
            let Some(resource) = entry.resource() else {
                continue;
            };
            let d = &entry.device;
            let known = self
                .known
                .get(resource)
                .is_some_and(|m| m.contains_key(&d.address));
            let bound = entry.is_bound();
            if !bound && !known {
                continue; // never advertised: not ours until it is bound
            }
            let problem = if !bound {
                Some(format!(
                    "on {} instead of {}",
                    d.driver.as_deref().unwrap_or("no driver"),
                    entry.target_driver
                ))
            } else {
                inv.group_problem(host, d.iommu_group)
            };
            let state = DeviceState {
                address: d.address,
                group: d.iommu_group,
                numa_node: d.numa_node,
                bridge: d.parent_bridge(),
                cdev: if self.iommufd {
                    sysfs_pci::cdev::vfio_cdev_name(host, &d.address)
                } else {
                    None
                },
                no_cdev_kernel,
                problem,
            };
            seen.entry(resource.clone())
                .or_default()
                .insert(d.address, state);
        }
        seen
    }

    /// The skipped devices not logged yet (or whose reason changed), among those the
    /// scan covered; a device that can be read again is forgotten, so it is logged
    /// again if it breaks again.
    fn note_skipped<'a>(
        &mut self,
        skipped: &'a [Skipped],
        scanned: impl Fn(&PciAddress) -> bool,
    ) -> Vec<&'a Skipped> {
        let news = self.skip_log.note_within(skipped, scanned);
        for address in news.recovered {
            tracing::info!(bdf = %address, "a device skipped before can be read again");
        }
        news.new
    }
}

/// Why the devices are not usable through this plugin now, read from the node's
/// owner lock without taking it (`passthrough::owner::Owner::holder`): its record
/// names another program than vfio-manager (sandbox-dra-driver). A running
/// vfio-manager holds the lock and its record names it, so a record of another
/// program means that program took the node, or vfio-manager is not there to
/// keep it. The record decides, not the `flock`: a holder in another container
/// is not listed in our `/proc/locks`. `None` without a lock file or record,
/// while the record names vfio-manager, and when the lock cannot be read (said,
/// and left to the next look).
pub fn owner_problem(lock: &std::path::Path) -> Option<String> {
    let holder = match passthrough::owner::Owner::holder(lock) {
        Ok(h) => h?,
        Err(e) => {
            tracing::warn!(lock = %lock.display(), error = %support::error_chain(&e),
                "cannot read the node's owner lock");
            return None;
        }
    };
    let r = holder.record.as_ref()?;
    let manager = "vfio-manager";
    (r.owner != manager).then(|| {
        format!(
            "the node's owner lock {} names {} (pid {}, since {}; {} device(s)), not \
                {manager}: no VM can be given the devices through the device plugin",
            lock.display(),
            r.owner,
            r.pid,
            r.since,
            r.devices
        )
    })
}

#[cfg(test)]
mod tests;
